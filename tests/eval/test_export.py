import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from wamrt.cli import main
from wamrt.eval.lerobot_export import export_lerobot
from wamrt.sim.record import load_episode, record_demos


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demos")
    metas = record_demos("lift", [0], out, env_kwargs={"exterior_hw": (64, 96)})
    assert len(metas) == 1 and metas[0].success
    return out


def test_recorded_episode_layout(demos):
    arrays, meta = load_episode(demos / "episode_000000.npz")
    t = meta["length"]
    assert arrays["actions"].shape == (t, 8) and arrays["joint_position"].shape == (t, 7)
    assert arrays["image_wrist"].shape == (t, 128, 192, 3) and arrays["image_front"].dtype == np.uint8
    assert json.loads((demos / "manifest.json").read_text())[0]["prompt"] == meta["prompt"]


def test_lerobot_v3_export(demos, tmp_path):
    av = pytest.importorskip("av")
    root = export_lerobot(sorted(demos.glob("episode_*.npz")), tmp_path / "ds")
    info = json.loads((root / "meta/info.json").read_text())
    arrays, meta = load_episode(demos / "episode_000000.npz")
    t = meta["length"]
    assert info["codebase_version"] == "v3.0" and info["total_frames"] == t and info["total_episodes"] == 1
    data = pq.read_table(root / "data/chunk-000/file-000.parquet").to_pandas()
    state = np.stack(data["observation.state"].to_numpy())
    np.testing.assert_array_equal(state[:, :7], arrays["joint_position"])  # exact round trip
    np.testing.assert_array_equal(np.stack(data["action"].to_numpy()), arrays["actions"])
    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert eps[0]["length"] == t and eps[0]["dataset_to_index"] == t and eps[0]["tasks"] == [meta["prompt"]]
    tasks = pq.read_table(root / "meta/tasks.parquet").to_pandas()
    assert list(tasks.index) == [meta["prompt"]]
    with av.open(str(root / "videos/observation.images.front/chunk-000/file-000.mp4")) as f:
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert len(frames) == t and np.abs(frames[0].astype(int) - arrays["image_front"][0]).mean() < 3


def compare_lerobot_readback(demo_files: list[Path], root: Path, dump: Path) -> dict:
    """Check what lerobot returned (dumped by tests/eval/lerobot_readback.py) against the source episodes."""
    got = dict(np.load(dump))
    episodes = [load_episode(f) for f in demo_files]
    n = sum(len(a["actions"]) for a, _ in episodes)
    assert len(got["action"]) == n
    state = np.concatenate([np.concatenate([a["joint_position"], a["gripper_position"][:, None]], 1)
                            for a, _ in episodes]).astype(np.float32)
    np.testing.assert_array_equal(got["observation.state"], state)  # exact: float32 in, float32 out
    np.testing.assert_array_equal(got["action"], np.concatenate([a["actions"] for a, _ in episodes]))
    np.testing.assert_array_equal(got["episode_index"], np.concatenate(
        [np.full(len(a["actions"]), i) for i, (a, _) in enumerate(episodes)]))
    np.testing.assert_array_equal(got["frame_index"], np.concatenate([np.arange(len(a["actions"]))
                                                                      for a, _ in episodes]))
    np.testing.assert_array_equal(got["index"], np.arange(n))
    assert list(got["task"]) == [m["prompt"] for a, m in episodes for _ in range(len(a["actions"]))]
    import av

    image_err = {}
    for cam in episodes[0][1]["cameras"]:
        src = np.concatenate([a[f"image_{cam}"] for a, _ in episodes]).astype(np.int16)
        dec = got[f"image/observation.images.{cam}"].astype(np.int16)
        assert dec.shape == src.shape
        # lerobot seeks each frame by timestamp (episode offset in the shared mp4 + frame time): it must land
        # on exactly the frame a plain sequential decode of the file yields at that position.
        with av.open(str(root / f"videos/observation.images.{cam}/chunk-000/file-000.mp4")) as f:
            seq = np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]).astype(np.int16)
        np.testing.assert_array_equal(dec, seq)
        err = np.abs(dec - src).mean(axis=(1, 2, 3))  # per frame; H.264 crf 18 is near-lossless
        assert err.max() < 3, (cam, err.max())
        image_err[cam] = {"equals_sequential_decode": True, "mean_abs_err_vs_source_mean": round(float(err.mean()), 3),
                          "mean_abs_err_vs_source_max": round(float(err.max()), 3)}
    return {"episodes": len(episodes), "frames": n, "cameras": sorted(image_err), "image_err": image_err}


@pytest.mark.slow
def test_lerobot_package_reads_export(tmp_path):
    """lerobot==0.4.4's own LeRobotDataset opens our export and reads every frame (videos via PyAV).

    lerobot runs in its own venv (it must not enter the default CI run); this test, in the dev venv, records
    3 pick_place expert demos and exports them through the CLI, runs tests/eval/lerobot_readback.py with that
    venv's python, and checks state/action (exact), indices, tasks and decoded frames against the source.
    Build the venv and run (bench/results/rollout/2026-11-30-lerobot-0.4.4-readback.txt has the details):

        python3.11 -m venv /work/lerobot-venv && P=/work/lerobot-venv/bin/pip
        $P install torch==2.13.0            # the local CPU wheel; lerobot pins torch<2.11 (CUDA-only on PyPI)
        $P install --no-deps lerobot==0.4.4 torchvision==0.25.0   # 0.25: the last with io.VideoReader
        $P install "datasets>=4,<5" "huggingface-hub>=0.34.2,<0.36" "av>=15,<16" "accelerate>=1.10,<2" \
            "packaging>=24.2,<26" pillow pandas pyarrow fsspec
        WAMRT_LEROBOT_PYTHON=/work/lerobot-venv/bin/python pytest -m slow -s tests/eval/test_export.py
    """
    python = os.environ.get("WAMRT_LEROBOT_PYTHON")
    if not python:
        pytest.skip("set WAMRT_LEROBOT_PYTHON to a python that has lerobot==0.4.4 (see the docstring)")
    demos, root, dump = tmp_path / "demos", tmp_path / "ds", tmp_path / "readback.npz"
    assert main(["demos", "record", "--task", "pick_place", "--episodes", "3", "--out", str(demos)]) == 0
    assert main(["export", "lerobot", "--demos", str(demos), "--out", str(root)]) == 0
    proc = subprocess.run([python, str(Path(__file__).with_name("lerobot_readback.py")), str(root), str(dump)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(dump.with_suffix(".json").read_text())
    assert summary["lerobot"] == "0.4.4" and summary["codebase_version"] == "v3.0"
    files = sorted(demos.glob("episode_*.npz"))
    assert summary["num_episodes"] == len(files) == 3
    result = compare_lerobot_readback(files, root, dump)
    assert summary["len"] == summary["num_frames"] == result["frames"]
    print(json.dumps({"lerobot_readback": summary, "checked": result}, indent=1))
