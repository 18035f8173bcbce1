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
