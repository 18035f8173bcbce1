"""`wamrt demo`: a real server subprocess, closed-loop episodes over the openpi websocket, an mp4."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _demo(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "WAMRT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "wamrt.cli", "demo", *args], capture_output=True, text=True,
                          timeout=600, env=full, cwd=tmp_path)


def test_demo_without_the_trained_policy_says_what_to_do(tmp_path):
    r = _demo(["--episodes", "1"], tmp_path, WAMRT_PANDA_DROID=str(tmp_path / "absent"))
    assert r.returncode == 2
    assert "the trained model 'panda-droid' is not present" in r.stderr and "--model tiny-droid" in r.stderr
    assert "Traceback" not in r.stderr


def test_demo_serves_runs_episodes_and_writes_the_video(tmp_path):
    import av

    from wamrt.net import free_port

    video, port = tmp_path / "episode.mp4", free_port()
    r = _demo(["--model", "tiny-droid", "--episodes", "2", "--max-steps", "8", "--video", str(video),
               "--port", str(port)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"--port {port} " in r.stdout.splitlines()[0]  # the server it started listens where it was told
    summary = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert summary["episodes"] == 2 and summary["errors"] == 0 and summary["mean_steps"] == 8.0
    assert summary["infer_p50_ms"] > 0 and len(summary["success_ci95"]) == 2
    with av.open(str(video)) as f:
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert len(frames) == 8 and frames[0].std() > 1.0  # the first episode, 8 rendered (non-blank) steps
