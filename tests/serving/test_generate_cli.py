"""`wamrt generate` on the built-in `tiny-world` (CPU): an MP4 with sound read back with PyAV, a PNG equal to what
the server's request path makes for the same fields and seed, image conditioning, and typed errors (exit 2)."""

from __future__ import annotations

import io
import json
import os

import av
import numpy as np
import pytest
import torch
from PIL import Image

from wamrt.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # the sound tokenizer uses weight_norm


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("WAMRT_CACHE", os.environ.get("WAMRT_CACHE") or str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


def test_video_with_sound_is_a_playable_mp4(tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    rc = main(["generate", "--prompt", "a red ball rolls across a table", "--size", "48x32", "--frames", "9",
               "--steps", "2", "--sound", "--device", "cpu", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["frames"] == [9, 32, 48, 3] and summary["sound"]["seconds"] > 0
    assert summary["sampler"]["steps"] == 2 and summary["engine"] == "eager"
    with av.open(io.BytesIO(out.read_bytes())) as container:
        assert {s.type for s in container.streams} == {"video", "audio"}
        frames = [f for f in container.decode(video=0)]
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (48, 32)


def test_png_equals_the_server_request_path(tmp_path):
    import wamrt
    from wamrt.serving.generation_request import build_generation
    from wamrt.serving.world_model import world_model_of

    out = tmp_path / "still.png"
    rc = main(["generate", "--prompt", "a wooden table", "--size", "32x48", "--steps", "2", "--seed", "7",
               "--device", "cpu", "--out", str(out), "--quiet"])
    assert rc == 0
    got = np.asarray(Image.open(out))
    world = world_model_of(wamrt.load_policy("tiny-world", device="cpu"), "tiny-world")
    req = build_generation({"prompt": "a wooden table", "size": "32x48", "num_inference_steps": "2", "seed": "7"},
                           world, kind="image", max_pixels=2**30)
    want = world.run(**req.kwargs, generator=torch.Generator().manual_seed(7)).frames[0].numpy()
    assert got.shape == (48, 32, 3) and np.array_equal(got, want)


def test_image_to_video(tmp_path):
    picture = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(picture)
    out = tmp_path / "i2v.mp4"
    rc = main(["generate", "--prompt", "the scene moves", "--image", str(picture), "--size", "48x32", "--frames",
               "5", "--steps", "2", "--device", "cpu", "--out", str(out), "--quiet"])
    assert rc == 0 and out.stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["--out", "x.gif"], "--out must end in .mp4 or .png"),
    (["--size", "50x32"], "size"),
    (["--frames", "6"], "num_frames"),
    (["--image", "missing.png"], "no such file"),
    (["--frames", "5", "--out", "x.png"], "one image"),
])
def test_bad_arguments_exit_2_naming_what_is_wrong(tmp_path, capsys, argv, message):
    base = ["generate", "--prompt", "p", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "o.mp4")]
    rc = main(base + argv)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_cpu_picks_small_defaults_and_says_so(tmp_path, capsys, monkeypatch):
    from wamrt.cli import generate
    from wamrt.serving.generation_request import VIDEO_DEFAULTS

    # The shipped CPU defaults are a small fraction of the GPU (vLLM-Omni) job ...
    cpu = generate.CPU_DEFAULTS["video"]
    w, h = (int(v) for v in cpu["size"].split("x"))
    cpu_work = w * h * int(cpu["num_frames"]) * int(cpu["num_inference_steps"])
    gpu = VIDEO_DEFAULTS
    gpu_work = gpu["width"] * gpu["height"] * gpu["num_frames"] * gpu["steps"]
    assert cpu_work * 100 < gpu_work
    # ... and a run that leaves size, frames and steps out gets them (patched smaller here, to stay fast).
    monkeypatch.setitem(generate.CPU_DEFAULTS, "video",
                        {"size": "48x32", "num_frames": "5", "num_inference_steps": "2"})
    rc = main(["generate", "--prompt", "a cup", "--device", "cpu", "--out", str(tmp_path / "o.mp4"), "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["frames"] == [5, 32, 48, 3] and summary["sampler"]["steps"] == 2
    assert "note: on a CPU, small defaults: size 48x32, num_frames 5, num_inference_steps 2" in captured.err
    # an explicit flag wins over the CPU default
    rc = main(["generate", "--prompt", "a cup", "--device", "cpu", "--steps", "1", "--out", str(tmp_path / "p.mp4"),
               "--json", "--quiet"])
    assert rc == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sampler"]["steps"] == 1


def test_a_long_job_is_announced_with_its_estimate(tmp_path, capsys, monkeypatch):
    from wamrt.cli import generate

    argv = ["generate", "--prompt", "a cup", "--size", "48x32", "--frames", "5", "--steps", "2", "--device", "cpu",
            "--out", str(tmp_path / "o.mp4"), "--quiet"]
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err  # seconds: nothing to warn about
    monkeypatch.setattr(generate, "LONG_JOB_S", 0.0)  # every job is "long": the estimate line appears once
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "this job will take about" in lines[0] and "2 steps" in lines[0]
