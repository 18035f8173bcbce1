"""World generation on a distilled (few-step) checkpoint over HTTP, CPU: `wamrt serve --sampler` and
`run_world_distilled` behind `/v1/videos`, `/v1/videos/sync` and `/v1/images/generations`.

The distilled checkpoint is built here: the embedded tiny-droid weights in a folder, plus what makes a folder
distilled for diffusers (`modular_model_index.json` with `distilled_sigmas`, read by
`Cosmos3DistilledModularPipeline`) and for vLLM-Omni (a `FlowMatchEulerDiscreteScheduler` scheduler config).

Covers: how the sampler is decided (folder, `--sampler`, startup errors naming the flag); a /sync MP4 with the
right frames whose frames are `run_world_distilled`'s with the same seed, bit for bit (and PNGs likewise);
per-step progress and DELETE on the async route; the fields a distilled checkpoint fixes (typed 400s, notes).
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest
import torch
from oracle.generation_jobs import poll_job, wait_generation_idle
from PIL import Image

import wamrt
from wamrt.cli import main as cli_main
from wamrt.pipeline.builtin import build_builtin
from wamrt.pipeline.world_distilled import load_distilled_schedule, run_world_distilled
from wamrt.serving import ServeConfig, ServerThread, generation
from wamrt.serving.config import ServeConfigError
from wamrt.serving.generation_settings import resolve_sampler
from wamrt.serving.world_model import world_model_of

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
SIGMAS = (1.0, 0.8333, 0.4125, 0.2)  # 4 steps, non-integer timesteps (as tests/pipeline/test_world_distilled.py)
LONG_SIGMAS = tuple(float(s) for s in np.linspace(1.0, 0.0025, 400))  # long enough to watch and cancel a job
MAX_PIXELS = 128 * 128 * 33
# Two encodes of the same frames that differ decode ~1 level apart on average (serving/media.encode_mp4's docstring).
H264_REENCODE_MEAN_LEVELS = 2.0


def declare_distilled(folder: Path, sigmas: Any = SIGMAS, *, index: bool = True) -> Path:
    """The two config files of a distilled diffusers checkpoint (`index=False`: the scheduler config only)."""
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    if index:
        (folder / "modular_model_index.json").write_text(json.dumps(
            {"_class_name": "Cosmos3DistilledModularPipeline", "_blocks_class_name": "Cosmos3DistilledBlocks",
             "distilled_sigmas": list(sigmas)}))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0, "stochastic_sampling": True,
         "num_train_timesteps": 1000}))
    return folder


def distilled_checkpoint(folder: Path, sigmas: Any) -> Path:
    return declare_distilled(build_builtin("tiny-droid", folder), sigmas)


@pytest.fixture(scope="module")
def distilled_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return distilled_checkpoint(tmp_path_factory.mktemp("distilled") / "ckpt", SIGMAS)


@pytest.fixture(scope="module")
def distilled_server(distilled_folder: Path) -> Iterator[ServerThread]:
    policy = wamrt.load_policy(str(distilled_folder), device="cpu")
    cfg = ServeConfig(model_name=str(distilled_folder), steps=1, max_batch=4, max_wait_ms=2.0,
                      max_video_pixels=MAX_PIXELS)  # --sampler auto
    with ServerThread(policy, cfg) as server:
        yield server


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as f:
        assert f.streams.video[0].codec_context.name == "h264" and not f.streams.audio
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def _direct(server: ServerThread, seed: int, **kw: Any) -> np.ndarray:
    """`run_world_distilled` called here on the served weights, with the server's defaults (templates off)."""
    policy = server.service.policy
    res = run_world_distilled(policy.model, policy.encoder, policy.tokenizer,
                              schedule=load_distilled_schedule(server.config.model_name),
                              use_resolution_template=False, use_duration_template=False,
                              generator=torch.Generator().manual_seed(seed), **kw)
    assert res.frames is not None
    return res.frames.numpy()






# --- which sampler ------------------------------------------------------------------------------------------


def test_sampler_is_decided_from_the_checkpoint(tmp_path: Path) -> None:
    distilled, base, bare = declare_distilled(tmp_path / "distilled"), tmp_path / "base", tmp_path / "bare"
    base.mkdir()
    (declare_distilled(bare) / "transformer").mkdir()
    assert resolve_sampler("auto", str(distilled)) == load_distilled_schedule(distilled)
    assert resolve_sampler("distilled", str(distilled)).sigmas == SIGMAS
    assert resolve_sampler("auto", str(bare / "transformer")).sigmas == SIGMAS  # a bare transformer folder
    assert resolve_sampler("unipc", str(distilled)) is None  # forced: UniPC on a distilled checkpoint
    for checkpoint in (str(base), "tiny-world", "random:tiny-qwen", ""):
        assert resolve_sampler("auto", checkpoint) is None
        with pytest.raises(ServeConfigError) as e:
            resolve_sampler("distilled", checkpoint)
        assert e.value.flag == "--sampler" and "not a distilled checkpoint" in str(e.value)
    # Declared distilled (vLLM-Omni's test: the scheduler class) without a schedule this runtime can read: an error
    # naming the flag, not UniPC in silence.
    half = declare_distilled(tmp_path / "half", index=False)
    with pytest.raises(ServeConfigError) as e:
        resolve_sampler("auto", str(half))
    assert e.value.flag == "--sampler" and "modular_model_index.json" in str(e.value) and "unipc" in str(e.value)
    assert resolve_sampler("unipc", str(half)) is None
    with pytest.raises(ServeConfigError) as e:
        ServeConfig(sampler="fast")
    assert e.value.flag == "--sampler"


def test_forcing_distilled_on_a_base_checkpoint_fails_at_startup(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Refused while the config is made, before any model is loaded (this folder has none to load)."""
    with pytest.raises(ServeConfigError) as e:
        ServeConfig(model_name=str(tmp_path), sampler="distilled")
    assert e.value.flag == "--sampler"
    assert cli_main(["serve", "--model", str(tmp_path), "--sampler", "distilled"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wamrt serve: --sampler:") and "not a distilled checkpoint" in err


def test_the_served_world_model_says_its_sampler(distilled_server: ServerThread, tiny_server: ServerThread) -> None:
    world = distilled_server.service.world
    assert world.sampler == "distilled" and world.schedule.sigmas == SIGMAS and world.schedule.stochastic
    forced = world_model_of(distilled_server.service.policy, distilled_server.config.model_name, "unipc")
    assert forced is not None and forced.sampler == "unipc" and forced.schedule is None
    # A base checkpoint's reply says UniPC, with the request's steps.
    r = httpx.post(tiny_server.http_url + "/v1/videos/sync", headers={"accept": "application/json"}, timeout=60,
                   data={"prompt": "p", "size": "32x32", "num_frames": "5", "num_inference_steps": "1"})
    assert r.status_code == 200, r.text
    meta = r.json()["metadata"]
    assert (meta["sampler"], meta["steps"], meta["guidance"], meta["shift"]) == ("unipc", 1, 6.0, 10.0)


# --- output --------------------------------------------------------------------------------------------------


def test_sync_video_is_the_distilled_samplers_bit_for_bit(distilled_server: ServerThread,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[np.ndarray] = []
    real = generation.encode_mp4

    def recording(frames: np.ndarray, *args: Any, **kw: Any) -> bytes:
        encoded.append(frames.copy())
        return real(frames, *args, **kw)

    monkeypatch.setattr(generation, "encode_mp4", recording)
    url = distilled_server.http_url
    form = {"prompt": "a robot arm stacks blocks", "size": "48x32", "num_frames": "9", "fps": "16", "seed": "7"}
    r = httpx.post(url + "/v1/videos/sync", data=form, headers={"accept": "video/mp4"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    stages = json.loads(r.headers["x-stage-durations"])
    assert {"step_noise", "denoise_step3", "vae_decode", "encode"} <= set(stages) and "denoise_step4" not in stages
    assert _frames(r.content).shape == (9, 32, 48, 3)  # playable, every frame

    direct = _direct(distilled_server, 7, prompt=form["prompt"], num_frames=9, height=32, width=48, fps=16.0)
    assert len(encoded) == 1 and encoded[0].dtype == np.uint8 and direct.std() > 0
    np.testing.assert_array_equal(encoded[0], direct)  # the served frames, before H.264

    body = httpx.post(url + "/v1/videos/sync", data=form, headers={"accept": "application/json"}, timeout=60).json()
    # Same seed, same frames bit for bit; the H.264 bytes are not always reproducible even on one x264 thread
    # (serving/media.encode_mp4: 4 versions in 30 inside this server; CI saw two in one run), so the files are
    # compared decoded, to within the codec's rounding.
    assert len(encoded) == 2
    np.testing.assert_array_equal(encoded[1], encoded[0])
    again = _frames(base64.b64decode(body["data"][0]["b64_json"]))
    assert again.shape == (9, 32, 48, 3)
    assert np.abs(again.astype(int) - _frames(r.content).astype(int)).mean() <= H264_REENCODE_MEAN_LEVELS
    meta = body["metadata"]
    assert {k: meta[k] for k in ("sampler", "steps", "guidance", "shift", "mode", "num_frames", "seed")} == {
        "sampler": "distilled", "steps": 4, "guidance": 1.0, "shift": 1.0, "mode": "text2video", "num_frames": 9,
        "seed": 7}
    assert "notes" not in meta and body["video"]["shape"] == [9, 32, 48, 3] and body["video"]["audio"] is None


def test_image_conditioned_video(distilled_server: ServerThread) -> None:
    """Image -> video, what the published distilled video checkpoint is for."""
    png = generation.encode_png(np.random.default_rng(1).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    r = httpx.post(distilled_server.http_url + "/v1/videos/sync", timeout=60, headers={"accept": "application/json"},
                   data={"prompt": "p", "size": "32x32", "num_frames": "5", "seed": "3"},
                   files={"input_reference": ("i.png", png)})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["mode"] == "image2video" and r.json()["metadata"]["sampler"] == "distilled"
    assert _frames(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (5, 32, 32, 3)


def test_images_are_the_distilled_samplers_bit_for_bit(distilled_server: ServerThread) -> None:
    body = {"prompt": "a red cube", "size": "32x48", "n": 2, "seed": 5}
    r = httpx.post(distilled_server.http_url + "/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 200, r.text
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in r.json()["data"]]
    for k, image in enumerate(images):  # image k uses seed + k
        direct = _direct(distilled_server, 5 + k, prompt="a red cube", num_frames=1, height=48, width=32)
        np.testing.assert_array_equal(image, direct[0])
    meta = r.json()["metadata"]
    assert (meta["sampler"], meta["steps"], meta["guidance"]) == ("distilled", 4, 1.0)


# --- progress and cancel on the async route ------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_distilled_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = distilled_checkpoint(tmp_path_factory.mktemp("distilled_long") / "ckpt", LONG_SIGMAS)
    cfg = ServeConfig(model_name=str(folder), steps=1, max_batch=4, max_wait_ms=2.0, max_video_pixels=MAX_PIXELS,
                      sampler="distilled")
    with ServerThread(wamrt.load_policy(str(folder), device="cpu"), cfg) as server:
        yield server


def test_async_progress_and_cancel(long_distilled_server: ServerThread) -> None:
    url, worker = long_distilled_server.http_url, long_distilled_server.service.generation
    job = {"prompt": "a long shot of a kitchen", "size": "80x48", "num_frames": "13", "fps": "16", "seed": "1"}
    vid = httpx.post(url + "/v1/videos", data=job).json()["id"]
    seen: list[int] = []
    while len(seen) < 4:
        cur = httpx.get(f"{url}/v1/videos/{vid}").json()
        assert cur["status"] in ("queued", "in_progress"), cur
        if cur["progress"] and (not seen or cur["progress"] > seen[-1]):
            seen.append(cur["progress"])
        time.sleep(0.02)
    assert seen == sorted(seen) and seen[-1] < 100  # once per distilled step
    assert httpx.delete(f"{url}/v1/videos/{vid}").json()["status"] == "cancelled"
    wait_generation_idle(long_distilled_server)
    cur = httpx.get(f"{url}/v1/videos/{vid}").json()
    assert cur["status"] == "cancelled" and cur["progress"] < 100
    assert httpx.get(f"{url}/v1/videos/{vid}/content").status_code == 409
    assert long_distilled_server.service.batcher.gate.demand == 0
    # The server still generates; a job runs the checkpoint's step count without being asked for it.
    runs = worker.jobs_run
    done = poll_job(url, httpx.post(url + "/v1/videos", data={**job, "size": "32x32", "num_frames": "5"}).json()["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and worker.jobs_run == runs + 1
    assert (done["metadata"]["sampler"], done["metadata"]["steps"]) == ("distilled", len(LONG_SIGMAS))
    assert _frames(httpx.get(f"{url}/v1/videos/{done['id']}/content").content).shape == (5, 32, 32, 3)


# --- the fields a distilled checkpoint fixes ---------------------------------------------------------------------

_TINY = {"prompt": "p", "size": "32x32", "num_frames": "5", "seed": "2"}


@pytest.mark.parametrize(("over", "field", "says"), [
    ({"num_inference_steps": "2"}, "num_inference_steps", "distilled to 4 steps"),
    ({"num_inference_steps": "35"}, "num_inference_steps", "distilled to 4 steps"),
    ({"generate_sound": "true"}, "generate_sound", "distilled sampler generates no sound"),
    ({"guidance_scale": "-1"}, "guidance_scale", "in [0, 100]"),
    ({"flow_shift": "0"}, "flow_shift", "in [0.001, 1000]"),
])
def test_refused_fields_are_typed(distilled_server: ServerThread, over: dict[str, str], field: str, says: str) -> None:
    url, records = distilled_server.http_url, distilled_server.app.state.video_jobs.records
    before = len(records)
    for path in ("/v1/videos", "/v1/videos/sync"):
        r = httpx.post(url + path, data={**_TINY, **over}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["code"] == "invalid_request" and r.json()["field"] == field and says in r.json()["message"]
    assert len(records) == before  # refused before any job record exists
    if field == "num_inference_steps":
        r = httpx.post(url + "/v1/images/generations", json={"prompt": "p", "size": "32x32", **over})
        assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_fields_the_checkpoint_fixes_are_ignored_with_a_note(distilled_server: ServerThread) -> None:
    """vLLM-Omni forces guidance 1 and the checkpoint's sigmas on a distilled Cosmos 3 checkpoint, so a request
    written for the base one (its recipe sends guidance 6, a negative prompt, flow shift 10) still runs; the reply
    says what was not used. The step count is the schedule's, asked for or not."""
    url = distilled_server.http_url
    plain = httpx.post(url + "/v1/videos/sync", data={**_TINY, "num_inference_steps": "4", "guidance_scale": "1"},
                       headers={"accept": "application/json"}, timeout=60).json()
    assert "notes" not in plain["metadata"] and plain["metadata"]["steps"] == 4
    recipe = {**_TINY, "guidance_scale": "6.0", "negative_prompt": "blurry, distorted", "flow_shift": "10.0"}
    body = httpx.post(url + "/v1/videos/sync", data=recipe, headers={"accept": "application/json"}, timeout=60).json()
    meta = body["metadata"]
    assert (meta["guidance"], meta["shift"], meta["steps"]) == (1.0, 1.0, 4)
    assert [n.split()[0] for n in meta["notes"]] == ["guidance_scale", "flow_shift", "negative_prompt"], meta["notes"]
    assert all("ignored" in n for n in meta["notes"])
    assert body["data"][0]["b64_json"] == plain["data"][0]["b64_json"]  # nothing of them reached the model
