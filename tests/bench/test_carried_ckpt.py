"""scripts/gpu_lib.sh's carried_ckpt: a checkpoint carried to a fresh device machine as a .tgz without its VAE."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def carried(path: str, tmp_path: Path) -> str:
    script = f'T0=0 RES={tmp_path}/res; mkdir -p "$RES"; source scripts/gpu_lib.sh; carried_ckpt "$1"'
    out = subprocess.run(["bash", "-c", script, "_", path], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    return out.stdout.strip()


def test_a_tgz_is_unpacked_with_panda_droids_vae_and_a_folder_is_itself(tmp_path):
    src = tmp_path / "src"
    (src / "transformer").mkdir(parents=True)
    (src / "transformer" / "config.json").write_text("{}")
    (src / "wamrt.json").write_text('{"tag": "carried-test"}')
    tgz = tmp_path / "carried-test-ckpt.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(src, arcname=".")
    folder = Path(carried(str(tgz), tmp_path))
    try:
        assert folder == Path("/tmp/wamrt-carried/carried-test-ckpt")
        assert (folder / "wamrt.json").read_text() == '{"tag": "carried-test"}'
        vae = ROOT / "src/wamrt/assets/panda-droid/vae/diffusion_pytorch_model.safetensors"
        assert (folder / "vae" / vae.name).read_bytes() == vae.read_bytes()
        (folder / "wamrt.json").write_text('{"tag": "unpacked once"}')  # a second call keeps what it unpacked
        assert Path(carried(str(tgz), tmp_path)) == folder and "once" in (folder / "wamrt.json").read_text()
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    assert carried("src/wamrt/assets/panda-droid", tmp_path) == "src/wamrt/assets/panda-droid"
