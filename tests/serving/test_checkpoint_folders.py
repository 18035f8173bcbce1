"""A user's checkpoint folder, as diffusers' `save_pretrained` writes it and as the hub repository (root weight
index) ships it: `wamrt infer`, `wamrt serve` (answering the official openpi-client) and `wamrt generate` run on
it with no symlink and no flag; a folder that cannot serve stops `wamrt serve` with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from oracle.checkpoints import save_diffusers_pipeline, to_hub_layout

from wamrt.cli import main
from wamrt.cli.demo import _wait_ready as wait_ready
from wamrt.net import free_port
from wamrt.sample import sample_observation

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")


@pytest.fixture(scope="module", params=["diffusers", "hub"])
def folder(request, tmp_path_factory) -> Path:
    out = save_diffusers_pipeline(tmp_path_factory.mktemp("folders") / request.param)
    return to_hub_layout(out) if request.param == "hub" else out


def _serve(folder: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "wamrt.cli", "serve", "--model", str(folder), "--port", str(port), "--device",
           "cpu", "--steps", "1", *extra]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), port


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    try:
        wait_ready(port, proc, timeout_s=240.0)
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()}") from exc


def test_serve_answers_openpi_client(folder: Path, tmp_path: Path) -> None:
    proc, port = _serve(folder, tmp_path / "server.log")
    try:
        _wait_ready(proc, port, tmp_path / "server.log")
        client = WebsocketClientPolicy(f"ws://127.0.0.1:{port}")
        assert client.get_server_metadata()["model"] == str(folder)
        obs = {k: v for k, v in sample_observation(0).items() if k != "observation/exterior_image_2_left"}
        out = client.infer(obs)  # openpi's DROID example: one exterior view
        assert out["actions"].shape == (32, 8) and np.isfinite(out["actions"]).all()
        assert "zero-filled" in out["metadata"]["notes"][0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_infer_and_generate(folder: Path, tmp_path: Path, capsys) -> None:
    assert main(["infer", "--model", str(folder), "--device", "cpu", "--steps", "1", "--json"]) == 0
    assert np.asarray(json.loads(capsys.readouterr().out)["actions"]).shape == (32, 8)
    out = tmp_path / "clip.mp4"
    assert main(["generate", "--model", str(folder), "--device", "cpu", "--prompt", "a robot arm", "--size", "64x48",
                 "--frames", "5", "--steps", "1", "--out", str(out), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["frames"] == [5, 48, 64, 3] and summary["sampler"]["shift"] == 7.0  # the scheduler's flow_shift
    with av.open(str(out)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 5


def test_serve_refuses_a_broken_folder_in_one_line(folder: Path, tmp_path: Path, capsys) -> None:
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    cfg = json.loads((broken / "vae" / "config.json").read_text())
    cfg["latents_mean"] = cfg["latents_mean"][:16]
    (broken / "vae" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["serve", "--model", str(broken), "--device", "cpu", "--port", str(free_port())]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"wamrt serve: {broken / 'vae' / 'config.json'}: latents_mean: has 16 entries but z_dim is 48"]
    shutil.rmtree(broken / "text_tokenizer")
    if (broken / "tokenizer.json").exists():  # the hub layout's root copy
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (broken / name).unlink()
    assert main(["serve", "--model", str(broken), "--device", "cpu", "--port", str(free_port())]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--tokenizer" in lines[0], lines
