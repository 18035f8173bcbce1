"""World-generation jobs over HTTP (vLLM-Omni `/v1/videos` fields, `/v1/images/generations`) on the embedded
`tiny-world` model (sound heads + a tiny sound tokenizer), CPU.

Covers: MP4 (H.264 + AAC) encoding read back with PyAV; a /v1/videos/sync request written as vLLM-Omni's
recipe writes it; async jobs whose progress rises and which DELETE cancels, freeing their tensors; a /sync
client that hangs up; every bad field as a typed 400 naming it; routing next to policy / dynamics jobs;
the decode's yield points leaving the output bit-exact; and policy latency with and without generation
running (the scheduling claim of docs/serving.md).
"""

from __future__ import annotations

import base64
import gc
import io
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import av
import httpx
import numpy as np
import pytest
import torch
from oracle.generation_jobs import poll_job, wait_generation_idle
from oracle.latency import percentile, policy_request_ms
from PIL import Image

from wamrt.client.wire import packb
from wamrt.sample import sample_observation
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.batcher import DeviceGate
from wamrt.serving.generation import GenerationJob, GenerationWorker
from wamrt.serving.generation_request import build_generation
from wamrt.serving.media import audio_rate, encode_mp4, encode_png
from wamrt.serving.world_model import world_model_of

# gc.get_objects() touches lazy torch attributes that warn on access; the sound tokenizer uses weight_norm.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
MAX_PIXELS = 128 * 128 * 33  # the world server's --max-video-pixels
REENCODE_MEAN_ABS_TOL = 3.0  # mean |difference| (0-255) of two H.264 encodes of the same frames
SOUND_RATE = 16_000  # tiny-world's sound tokenizer


@pytest.fixture(scope="module")
def world_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    policy = wamrt.load_policy("tiny-world", device="cpu")
    cfg = ServeConfig(model_name="tiny-world", steps=1, max_batch=4, max_wait_ms=2.0, max_video_pixels=MAX_PIXELS)
    with ServerThread(policy, cfg) as server:
        yield server


def _png(h: int = 40, w: int = 56) -> bytes:
    return encode_png(np.random.default_rng(1).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _mp4(frames: int = 9, h: int = 40, w: int = 56) -> bytes:
    ramp = (np.arange(frames, dtype=np.uint8) * 20)[:, None, None, None]
    return encode_mp4(np.broadcast_to(ramp, (frames, h, w, 3)).copy(), 16.0)


def _streams(mp4: bytes) -> tuple[np.ndarray, dict[str, Any] | None]:
    """Decoded RGB frames and the audio stream's facts (None without one)."""
    with av.open(io.BytesIO(mp4)) as f:
        assert f.streams.video[0].codec_context.name == "h264"
        frames = np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])
    with av.open(io.BytesIO(mp4)) as f:
        if not f.streams.audio:
            return frames, None
        a = f.streams.audio[0]
        info = {"codec": a.codec_context.name, "rate": a.rate, "channels": a.channels,
                "seconds": float(a.duration * a.time_base)}
        info["samples"] = sum(fr.samples for fr in f.decode(audio=0))
    return frames, info




def _latents_alive(shape: tuple[int, ...]) -> int:
    def is_latent(o: Any) -> bool:
        try:
            return isinstance(o, torch.Tensor) and tuple(o.shape) == shape
        except ReferenceError:  # a weakref proxy whose object is gone (compiled code leaves some behind)
            return False

    return sum(map(is_latent, gc.get_objects()))




# --- media -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "channels"), [(16_000, 2), (48_000, 2), (44_100, 1), (1_600, 1)])
def test_mp4_round_trip_with_sound(rate: int, channels: int) -> None:
    yy, xx = np.mgrid[0:48, 0:80]
    frames = np.stack([np.stack([2 * xx + 10 * k, 4 * yy, 128 + 0 * xx], -1) for k in range(9)]).astype(np.uint8)
    seconds = 9 / 16
    t = np.arange(int(seconds * rate)) / rate
    wave = np.stack([0.5 * np.sin(2 * np.pi * 220 * (c + 1) * t) for c in range(channels)]).astype(np.float32)
    decoded, audio = _streams(encode_mp4(frames, 16.0, wave, rate))
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(float) - frames).mean() < 2  # H.264 at CRF 18 on smooth pixels
    assert audio is not None and audio["codec"] == "aac" and audio["channels"] == channels
    assert audio["rate"] == audio_rate(rate) == (rate if rate != 1_600 else 7_350)  # 1.6 kHz: no AAC rate
    assert abs(audio["seconds"] - seconds) < 2e-3  # the stream says the waveform's duration
    # Decoding yields whole 1024-sample AAC frames (plus the resampler's delay when resampling).
    assert seconds * audio["rate"] <= audio["samples"] <= seconds * audio["rate"] + 3 * 1024


def test_mp4_encoding_reports_bad_input() -> None:
    frames = np.zeros((3, 48, 64, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="uint8"):
        encode_mp4(frames.astype(np.float32), 24.0)
    with pytest.raises(ValueError, match="sample_rate"):
        encode_mp4(frames, 24.0, np.zeros((2, 100), dtype=np.float32))


def test_mp4_without_sound_and_png() -> None:
    frames = np.zeros((5, 33, 31, 3), np.uint8)
    decoded, audio = _streams(encode_mp4(frames, 29.97))
    assert decoded.shape == (5, 32, 30, 3) and audio is None  # odd sizes lose a row / column (yuv420p)
    img = np.random.default_rng(2).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(encode_png(img)))), img)


# --- the vLLM-Omni request ---------------------------------------------------------------------------


def _vllm_omni_form(**over: str) -> dict[str, str]:
    """Recipes/cosmos3 "Text-to-video-with-sound", at a size the tiny model runs in ~0.1 s."""
    form = {"model": "tiny-world", "prompt": "A robotic arm picks up a pear and places it in a bag.",
            "negative_prompt": "blurry, distorted, low quality", "size": "64x48", "num_frames": "9", "fps": "16",
            "num_inference_steps": "4", "guidance_scale": "6.0", "max_sequence_length": "4096",
            "flow_shift": "10.0", "seed": "0", "generate_sound": "true", "sound_duration": "0.5625",
            "extra_params": json.dumps({"use_resolution_template": False, "use_duration_template": False,
                                        "guardrails": True})}
    return {**form, **over}


def test_sync_text_to_video_with_sound_is_a_playable_mp4(world_server: ServerThread) -> None:
    url = world_server.http_url
    r = httpx.post(url + "/v1/videos/sync", data=_vllm_omni_form(), headers={"accept": "video/mp4"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert r.headers["x-request-id"].startswith("video_sync-") and r.headers["x-model"] == "tiny-world"
    stages = json.loads(r.headers["x-stage-durations"])
    assert {"denoise", "vae_decode", "sound_decode", "encode"} <= set(stages)
    frames, audio = _streams(r.content)
    assert frames.shape == (9, 48, 64, 3) and frames.std() > 0
    assert audio is not None and audio["codec"] == "aac" and audio["rate"] == SOUND_RATE and audio["channels"] == 2
    assert abs(audio["seconds"] - 9 / 16) < 1 / 25  # sound for the whole clip (within one sound latent frame)
    # The JSON form (Accept: application/json): the same video (same seed) in b64_json, and the job's facts. The
    # frames are compared decoded: x264 is not bit-reproducible in this process (the same frames came out in 4
    # versions in 30 encodes, 1.1 levels apart on average, against 34.6 levels of coding loss on this noise).
    reply = httpx.post(url + "/v1/videos/sync", data=_vllm_omni_form(), headers={"accept": "application/json"},
                       timeout=60)
    body = reply.json()
    assert body["id"] == reply.headers["x-request-id"] and body["id"].startswith("video_sync-")  # one id, as logged
    json_frames, json_audio = _streams(base64.b64decode(body["data"][0]["b64_json"]))
    assert json_frames.shape == frames.shape and json_audio == audio
    assert np.abs(json_frames.astype(int) - frames.astype(int)).mean() <= REENCODE_MEAN_ABS_TOL
    assert body["video"]["shape"] == [9, 48, 64, 3] and body["video"]["audio"]["sample_rate"] == SOUND_RATE
    meta = body["metadata"]
    assert meta["mode"] == "text2video" and meta["seed"] == 0 and meta["sound"] is True and meta["steps"] == 4
    assert any("guardrail" in n for n in meta["notes"])  # requested, and said to be absent


def test_image_and_video_conditioning(world_server: ServerThread) -> None:
    url = world_server.http_url
    base = _vllm_omni_form(generate_sound="false", num_inference_steps="2")
    base.pop("sound_duration")
    r = httpx.post(url + "/v1/videos/sync", data={**base, "seed": "3"}, files={"input_reference": ("i.png", _png())},
                   headers={"accept": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["mode"] == "image2video" and r.json()["video"]["audio"] is None
    ep = json.dumps({"condition_frame_indexes_vision": [0, 1], "condition_video_keep": "last"})
    r = httpx.post(url + "/v1/videos/sync", data={**base, "extra_params": ep},
                   files={"input_reference": ("v.mp4", _mp4(), "video/mp4")}, headers={"accept": "application/json"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["metadata"]["mode"] == "video2video", r.text


def test_images_generations(world_server: ServerThread) -> None:
    url = world_server.http_url
    body = {"model": "tiny-world", "prompt": "a red cube", "size": "32x48", "n": 2, "response_format": "b64_json",
            "num_inference_steps": 3, "guidance_scale": 7.0, "seed": 5}
    r = httpx.post(url + "/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == r.headers["x-request-id"] and r.json()["id"].startswith("image-")
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in r.json()["data"]]
    assert [im.shape for im in images] == [(48, 32, 3)] * 2
    assert not np.array_equal(images[0], images[1])  # image k uses seed + k
    again = httpx.post(url + "/v1/images/generations", json={**body, "n": 1}, timeout=60).json()
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(again["data"][0]["b64_json"])))),
                                  images[0])


# --- async jobs, cancellation, memory ------------------------------------------------------------------

# 80x48 pixels, 13 frames -> latents [1, 48, 4, 3, 5]: a shape nothing else in the process has.
LONG_JOB = {"prompt": "a long shot of a kitchen", "size": "80x48", "num_frames": "13", "fps": "16",
            "num_inference_steps": "1000", "seed": "1"}
LONG_LATENTS = (1, 48, 4, 3, 5)


def test_async_job_progress_then_delete_cancels_and_frees(world_server: ServerThread) -> None:
    url, worker = world_server.http_url, world_server.service.generation
    rec = httpx.post(url + "/v1/videos", data=LONG_JOB).json()
    vid = rec["id"]
    assert rec["status"] == "queued" and rec["progress"] == 0 and vid.startswith("video_gen_")
    seen = []
    while len(seen) < 4:
        cur = httpx.get(f"{url}/v1/videos/{vid}").json()
        assert cur["status"] in ("queued", "in_progress"), cur
        if cur["progress"] and (not seen or cur["progress"] > seen[-1]):
            seen.append(cur["progress"])
        time.sleep(0.02)
    assert seen == sorted(seen) and seen[-1] < 100  # rises step by step, 100 only when done
    assert _latents_alive(LONG_LATENTS) > 0  # the check below can see this job's tensors
    assert httpx.get(f"{url}/v1/videos/{vid}/content").status_code == 409  # not finished
    r = httpx.delete(f"{url}/v1/videos/{vid}").json()
    assert r == {"id": vid, "object": "video.deleted", "deleted": True, "status": "cancelled"}
    wait_generation_idle(world_server)  # stopped at the next step boundary
    cur = httpx.get(f"{url}/v1/videos/{vid}").json()
    assert cur["status"] == "cancelled" and cur["error"]["code"] == "cancelled" and cur["progress"] < 100
    content = httpx.get(f"{url}/v1/videos/{vid}/content")
    assert content.status_code == 409 and content.json()["code"] == "conflict"
    # Freed: no tensor of the job left (without a collection: nothing holds them, not even in a cycle), no job
    # object, no queued device demand.
    assert _latents_alive(LONG_LATENTS) == 0
    gc.collect()
    assert sum(isinstance(o, GenerationJob) for o in gc.get_objects()) == 0
    assert world_server.service.batcher.gate.demand == 0 and vid not in world_server.app.state.video_jobs.tasks
    # A second DELETE removes the record; the server still generates.
    assert httpx.delete(f"{url}/v1/videos/{vid}").json()["deleted"] is True
    assert httpx.get(f"{url}/v1/videos/{vid}").status_code == 404
    jobs_before = worker.jobs_run
    done = poll_job(url, httpx.post(url + "/v1/videos", data={**LONG_JOB, "num_inference_steps": "2"}).json()["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and worker.jobs_run == jobs_before + 1
    assert done["video"]["shape"] == [13, 48, 80, 3] and done["file_name"] == f"{done['id']}.mp4"
    frames, _ = _streams(httpx.get(f"{url}/v1/videos/{done['id']}/content").content)
    assert frames.shape == (13, 48, 80, 3)


def test_sync_client_that_hangs_up_cancels_its_job(world_server: ServerThread) -> None:
    url, worker = world_server.http_url, world_server.service.generation
    started = worker.jobs_run
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/videos/sync", data=LONG_JOB, timeout=0.5)  # 1000 steps: ~4 s if it ran on
    t0 = time.monotonic()
    wait_generation_idle(world_server)
    assert time.monotonic() - t0 < 2.5 and worker.jobs_run == started + 1  # stopped, not finished
    assert _latents_alive(LONG_LATENTS) == 0 and world_server.service.batcher.gate.demand == 0


def test_queued_job_deleted_never_runs(world_server: ServerThread) -> None:
    url, worker = world_server.http_url, world_server.service.generation
    first = httpx.post(url + "/v1/videos", data=LONG_JOB).json()["id"]
    poll_job(url, first, until=("in_progress",))
    second = httpx.post(url + "/v1/videos", data=LONG_JOB).json()["id"]
    assert httpx.get(f"{url}/v1/videos/{second}").json()["status"] == "queued"
    runs = worker.jobs_run
    for vid in (second, first):
        assert httpx.delete(f"{url}/v1/videos/{vid}").json()["status"] == "cancelled"
    wait_generation_idle(world_server)
    assert worker.jobs_run == runs + 1  # only the first one ever started
    assert httpx.get(f"{url}/v1/videos/{second}").json()["status"] == "cancelled"


# --- bad input -------------------------------------------------------------------------------------------


def _ep(**kw: Any) -> str:
    return json.dumps(kw)


_TINY = {"prompt": "p", "size": "32x32", "num_frames": "5", "num_inference_steps": "1"}
_VIDEO_REF = json.dumps({"video_url": "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()})
BAD: dict[str, tuple[dict[str, str], dict[str, Any], str]] = {
    "size_not_multiple_of_16": ({**_TINY, "size": "100x64"}, {}, "size"),
    "size_garbage": ({**_TINY, "size": "big"}, {}, "size"),
    "width_not_multiple_of_16": ({"prompt": "p", "width": "40", "num_frames": "5"}, {}, "width"),
    "frames_not_4k_plus_1": ({**_TINY, "num_frames": "8"}, {}, "num_frames"),
    "frames_zero": ({**_TINY, "num_frames": "0"}, {}, "num_frames"),
    "oversize_video": ({**_TINY, "size": "128x128", "num_frames": "37"}, {}, "num_frames"),
    "oversize_frame": ({**_TINY, "size": "1024x1024", "num_frames": "1"}, {}, "size"),
    "image_and_video": ({**_TINY, "video_reference": _VIDEO_REF}, {"input_reference": ("i.png", _png())},
                        "video_reference"),
    "image_for_one_frame": ({**_TINY, "num_frames": "1"}, {"input_reference": ("i.png", _png())},
                            "input_reference"),
    "garbage_upload": (_TINY, {"input_reference": ("x.mp4", b"\x00 not media")}, "input_reference"),
    "sound_not_boolean": ({**_TINY, "generate_sound": "maybe"}, {}, "generate_sound"),
    "sound_duration_without_sound": ({**_TINY, "sound_duration": "0.2"}, {}, "sound_duration"),
    "sound_duration_not_the_clip": ({**_TINY, "generate_sound": "true", "sound_duration": "3"}, {},
                                    "sound_duration"),
    "extra_params_bad_json": ({**_TINY, "extra_params": "{"}, {}, "extra_params"),
    "extra_params_not_object": ({**_TINY, "extra_params": "[1]"}, {}, "extra_params"),
    "extra_params_transfer": ({**_TINY, "extra_params": _ep(edge=True)}, {}, "extra_params.edge"),
    "template_not_boolean": ({**_TINY, "extra_params": _ep(use_resolution_template="yes")}, {},
                             "extra_params.use_resolution_template"),
    "condition_frame_outside": ({**_TINY, "extra_params": _ep(condition_frame_indexes_vision=[0, 9])},
                                {"input_reference": ("v.mp4", _mp4())}, "extra_params.condition_frame_indexes_vision"),
    "condition_without_video": ({**_TINY, "extra_params": _ep(condition_frame_indexes_vision=[0])}, {},
                                "extra_params.condition_frame_indexes_vision"),
    "condition_keep": ({**_TINY, "extra_params": _ep(condition_video_keep="middle")},
                       {"input_reference": ("v.mp4", _mp4())}, "extra_params.condition_video_keep"),
    "guardrails_not_boolean": ({**_TINY, "extra_params": _ep(guardrails="on")}, {}, "extra_params.guardrails"),
    "fps_zero": ({**_TINY, "fps": "0"}, {}, "fps"),
    "steps_zero": ({**_TINY, "num_inference_steps": "0"}, {}, "num_inference_steps"),
    "guidance_negative": ({**_TINY, "guidance_scale": "-1"}, {}, "guidance_scale"),
    "shift_zero": ({**_TINY, "flow_shift": "0"}, {}, "flow_shift"),
    "seed_negative": ({**_TINY, "seed": "-3"}, {}, "seed"),
    "unsupported_true_cfg": ({**_TINY, "true_cfg_scale": "4"}, {}, "true_cfg_scale"),
    "missing_prompt": ({k: v for k, v in _TINY.items() if k != "prompt"}, {}, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_generation_fields_are_typed(world_server: ServerThread, case: str) -> None:
    form, files, field = BAD[case]
    url = world_server.http_url
    before = len(world_server.app.state.video_jobs.records)
    for path in ("/v1/videos", "/v1/videos/sync"):
        r = httpx.post(url + path, data=form, files=files or None, timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()
        assert err["code"] == "invalid_request" and err["field"] == field, err
    assert len(world_server.app.state.video_jobs.records) == before  # refused before any job record exists


@pytest.mark.parametrize(("body", "field"), [({"response_format": "url"}, "response_format"), ({"n": 11}, "n"),
                                             ({"size": "30x30"}, "size"), ({"size": "1024x1024"}, "size"),
                                             ({"n": 10, "size": "512x512"}, "n")])
def test_bad_image_fields_are_typed(world_server: ServerThread, body: dict[str, Any], field: str) -> None:
    r = httpx.post(world_server.http_url + "/v1/images/generations", json={"prompt": "p", "size": "32x32", **body})
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_sound_on_a_checkpoint_without_sound_heads(tiny_server: Any) -> None:
    """tiny-droid: transformer and VAE (so video works), no sound heads -> 400 naming generate_sound."""
    r = httpx.post(tiny_server.http_url + "/v1/videos/sync", data={**_TINY, "generate_sound": "true"})
    assert r.status_code == 400 and r.json()["field"] == "generate_sound" and "sound heads" in r.json()["message"]
    r = httpx.post(tiny_server.http_url + "/v1/videos/sync", data=_TINY, timeout=60)
    assert r.status_code == 200 and _streams(r.content)[1] is None


def test_routing_policy_dynamics_generation(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    """No action_mode and no policy input = generation; a policy input (the state, robot_obs, ...) keeps a request
    a policy request; a stand-in engine without a model refuses generation naming `model`."""
    url = fake_server.http_url
    r = httpx.post(url + "/v1/videos/sync", data={"prompt": "a cat"})
    assert r.status_code == 400 and r.json()["field"] == "model", r.text
    state = [*obs["observation/joint_position"].tolist(), 0.1]
    composite = encode_png(np.zeros((540, 640, 3), np.uint8))
    r = httpx.post(url + "/v1/videos/sync", data={"prompt": "pick", "extra_params": json.dumps({"action": state})},
                   files={"input_reference": ("c.png", composite)})
    assert r.status_code == 200 and r.json()["data"][0]["action"]["shape"] == [32, 8], r.text
    r = httpx.post(url + "/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 400 and r.json()["field"] == "model"


def test_openapi_documents_generation(fake_server: ServerThread) -> None:
    spec = httpx.get(fake_server.http_url + "/openapi.json").json()
    form = spec["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"generate_sound", "sound_duration", "num_frames", "fps", "size", "negative_prompt", "input_reference",
            "extra_params"} <= set(form["properties"])
    assert "use_resolution_template" in form["properties"]["extra_params"]["description"]
    assert "409" in spec["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    assert "/v1/images/generations" in spec["paths"]


# --- scheduling ----------------------------------------------------------------------------------------------


class MeddlingGate(DeviceGate):
    """Policy work is always waiting: generation yields at every point, and each gap runs a VAE encode (what a
    policy batch does there), which resets the decoder's feature cache."""

    def __init__(self, encoder: Any) -> None:
        super().__init__()
        self.encoder, self.demand, self.meddled = encoder, 1, 0

    def acquire_generation(self, cancelled: Any = lambda: False) -> None:
        with torch.inference_mode():
            self.encoder.encode(torch.zeros(1, 3, 1, 32, 32))
        self.meddled += 1
        self._generation_holders += 1


YIELD_FIELDS = {"prompt": "p", "size": "32x48", "num_frames": "13", "num_inference_steps": "2", "seed": "9",
                "generate_sound": "true"}


class EncodedMedia:
    """What a job handed to the MP4 encoder: the pipeline's output itself. (x264's bytes for the same frames have
    been seen to differ from one job on the worker thread to the next, so the MP4 bytes are not compared.)"""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import wamrt.serving.generation as generation

        self.calls: list[tuple[np.ndarray, np.ndarray | None]] = []
        encode = generation.encode_mp4

        def recording(frames: np.ndarray, fps: float, audio: np.ndarray | None = None, *args: Any, **kw: Any):
            self.calls.append((frames.copy(), None if audio is None else np.array(audio, copy=True)))
            return encode(frames, fps, audio, *args, **kw)

        monkeypatch.setattr(generation, "encode_mp4", recording)


def same_media(a: tuple[np.ndarray, np.ndarray | None], b: tuple[np.ndarray, np.ndarray | None]) -> bool:
    return np.array_equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (a[1] is None or
                                                                                np.array_equal(a[1], b[1]))


def undisturbed_and_meddled(world: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, MeddlingGate]:
    """The YIELD_FIELDS job run twice: alone, then yielding to a policy encode at every step and decoded frame.
    Returns the frames and sound each run handed to the MP4 encoder, and the meddling gate."""
    req = build_generation(YIELD_FIELDS, world, max_pixels=MAX_PIXELS)
    media, meddling = EncodedMedia(monkeypatch), MeddlingGate(world.encoder)
    for gate in (DeviceGate(), meddling):
        worker = GenerationWorker(world, gate, max_jobs=1)
        try:
            job = GenerationJob(req, "yields")
            worker.submit(job)
            assert job.future.result(60).shape == [13, 48, 32, 3]  # size is WxH
        finally:
            worker.stop()
    assert len(media.calls) == 2 and media.calls[0][1] is not None  # with sound
    return media.calls[0], media.calls[1], meddling


def test_decode_yields_keep_the_output_exact(world_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation paused between VAE-decoded frames while a policy batch encodes with the same VAE (which
    resets the decoder's feature cache) still produces exactly the frames and sound of an undisturbed run."""
    alone, meddled, gate = undisturbed_and_meddled(world_model_of(world_server.service.policy, "tiny-world"),
                                                   monkeypatch)
    assert gate.meddled >= 2 + 4  # steps and latent frames of the decode
    assert same_media(alone, meddled)


def test_generation_through_a_world_engine_yields_and_stays_exact(world_server: ServerThread,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA server does (`WorldModel.engine`, here without graphs): the job runs on the WorldEngine (its
    Reasoner cache fills), still yields at every step and decoded frame, and equals an undisturbed run; with
    every step split in two (`step_segments`, --generation-step-segments) it also yields once inside each step,
    and the output stays the same."""
    from dataclasses import replace

    from wamrt.engine import EngineConfig
    from wamrt.engine.world import WorldEngine

    base = world_model_of(world_server.service.policy, "tiny-world")
    assert base.engine is None  # a CPU server keeps run_world
    config = EngineConfig(attention="auto", compile=False, cuda_graph=False, prompt_bucket=64)
    engine = WorldEngine(base.model, base.encoder, base.tokenizer, config)
    alone, meddled, gate = undisturbed_and_meddled(replace(base, engine=engine), monkeypatch)
    assert engine.kv_cache.misses == 2 and engine.kv_cache.hits == 2  # both branches, then cached
    assert gate.meddled >= 2 + 4
    assert same_media(alone, meddled)

    split = WorldEngine(base.model, base.encoder, base.tokenizer, config, step_segments=2)
    split_alone, split_meddled, split_gate = undisturbed_and_meddled(replace(base, engine=split), monkeypatch)
    steps = int(YIELD_FIELDS["num_inference_steps"])
    assert split_gate.meddled == gate.meddled + steps  # one more yield inside every step
    assert same_media(split_alone, alone) and same_media(split_meddled, alone)


def test_policy_latency_with_and_without_generation(world_server: ServerThread) -> None:
    """Closed-loop policy requests (HTTP, msgpack) before, during and after continuous generation (a lane of
    back-to-back /v1/videos/sync jobs: 128x128, 33 frames, 12 steps, so steps, VAE decode frames and sound all
    run). The design bound: a policy request waits at most one generation segment (`segment_max_ms`, measured
    by the worker); on top, 1.5x the quiet p90 (2x its maximum) absorbs the CPU work generation does outside the
    device gate (multipart parsing, MP4 encoding, the event loop) and a shared 2-core CI box's noise. Serialising a job
    instead (FIFO, as forward dynamics runs) would add up to the whole job, ~0.5-1 s here."""
    n = int(os.environ.get("WAMRT_LATENCY_N", "12"))
    url, worker = world_server.http_url, world_server.service.generation
    obs = sample_observation(0)
    for key in ("observation/wrist_image_left", "observation/exterior_image_1_left",
                "observation/exterior_image_2_left"):
        obs[key] = np.ascontiguousarray(obs[key][::4, ::4])
    blob = packb(obs)
    job = {"prompt": "a busy kitchen", "size": "128x128", "num_frames": "33", "num_inference_steps": "12",
           "generate_sound": "true", "seed": "2"}

    with httpx.Client(base_url=url, timeout=60) as http:
        policy_ms = partial(policy_request_ms, http, blob)

        for _ in range(2):
            policy_ms()
        quiet = [policy_ms() for _ in range(n)]

        stop, done, errors = threading.Event(), [], []

        def generation_lane() -> None:
            with httpx.Client(base_url=url, timeout=120) as gen:
                while not stop.is_set():
                    r = gen.post("/v1/videos/sync", data=job)
                    (done if r.status_code == 200 else errors).append((r.status_code, r.text[:300]))

        lane = threading.Thread(target=generation_lane)
        segment_before, jobs_before = worker.segment_max_ms, worker.jobs_run
        worker.segment_max_ms = 0.0
        lane.start()
        deadline = time.monotonic() + 10
        while worker.running is None and time.monotonic() < deadline:
            time.sleep(0.005)
        busy = [policy_ms() for _ in range(n)]
        stop.set()
        lane.join(60)
        quiet += [policy_ms() for _ in range(n)]
    segment = worker.segment_max_ms
    worker.segment_max_ms = max(segment, segment_before)
    assert not errors and worker.jobs_run > jobs_before  # generation really ran meanwhile

    q50, q99 = statistics.median(quiet), percentile(quiet, 99)
    b50, b99 = statistics.median(busy), percentile(busy, 99)
    print(f"\npolicy latency ms: quiet p50 {q50:.1f} p99 {q99:.1f} | with generation p50 {b50:.1f} p99 {b99:.1f} "
          f"| longest generation segment {segment:.1f} ms | generation jobs finished {len(done)}")
    b90, q90 = percentile(busy, 90), percentile(quiet, 90)
    assert b90 <= 1.5 * q90 + segment, (quiet, busy, segment)
    assert b50 <= 1.25 * q50 + segment, (quiet, busy, segment)
    # The slowest request (p99 of 12 is the maximum): a factor 2 leaves room for one scheduler hiccup of the 2-core
    # box (a fresh-clone CI run at 6a1f331 saw 223 ms against 1.5 x 103 + 46), and still fails a request that waits
    # for a whole job (0.5-1 s here).
    assert b99 <= 2 * q99 + segment, (quiet, busy, segment)


def test_stored_videos_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished jobs' MP4s stay in memory up to MAX_CONTENT_BYTES in all; beyond, the oldest finished jobs go."""
    from types import SimpleNamespace

    from wamrt.serving import video_jobs

    monkeypatch.setattr(video_jobs, "MAX_CONTENT_BYTES", 250)
    jobs = video_jobs.VideoJobs(SimpleNamespace(config=ServeConfig()))  # type: ignore[arg-type]
    for i, status in enumerate(("completed", "in_progress", "completed", "completed")):
        jobs.records[f"v{i}"] = {"status": status}
    jobs.content["v1"] = b"x" * 100  # unfinished jobs are never evicted (not that one would hold content)
    jobs.store("v0", b"x" * 100)
    jobs.store("v2", b"x" * 100)
    assert set(jobs.records) == {"v1", "v2", "v3"} and set(jobs.content) == {"v1", "v2"}  # v0 went
    jobs.store("v3", b"x" * 100)
    assert set(jobs.content) == {"v1", "v3"} and "v2" not in jobs.records
    jobs.store("gone", b"x")  # deleted meanwhile: nothing stored
    assert "gone" not in jobs.content


def test_generation_step_segments_flag_reaches_the_config_and_is_checked() -> None:
    import argparse

    from wamrt.cli.serve import add_arguments
    from wamrt.serving.config import ServeConfigError
    from wamrt.serving.server import config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args([])).generation_step_segments == ServeConfig.generation_step_segments
    assert config_from_args(ap.parse_args(["--generation-step-segments", "3"])).generation_step_segments == 3
    with pytest.raises(ServeConfigError) as err:
        config_from_args(ap.parse_args(["--generation-step-segments", "0"]))
    assert err.value.flag == "--generation-step-segments" and ">= 1" in str(err.value)


def test_generation_warmup_runs_before_ready_and_names_bad_input(tmp_path: Any) -> None:
    """`--generation-warmup`: each job runs through the generation thread before /readyz turns 200; a value that
    is not a JSON object, or names a missing file, fails at startup naming the flag; a job the server refuses
    leaves /readyz at 503 with the field in the error."""
    import wamrt
    from wamrt.serving.config import ServeConfigError

    for bad, words in (("not json", "not JSON"), ("[1]", "JSON object"),
                       ('{"input_reference": "@/no/such/file.png"}', "is not a file")):
        with pytest.raises(ServeConfigError, match=words) as err:
            ServeConfig(model_name="tiny-world", generation_warmup=(bad,))
        assert err.value.flag == "--generation-warmup"

    policy = wamrt.load_policy("tiny-world", device="cpu")
    shape = '{"size": "48x32", "num_frames": "5", "num_inference_steps": "2", "input_reference": "@sample"}'
    cfg = ServeConfig(model_name="tiny-world", steps=1, max_video_pixels=MAX_PIXELS, generation_warmup=(shape,))
    with ServerThread(policy, cfg) as server:
        ready = httpx.get(server.http_url + "/readyz")
        assert ready.status_code == 200, ready.text
        assert server.service.generation is not None and server.service.generation.jobs_run == 1

    refused = '{"size": "50x32", "num_frames": "5"}'  # 50 is not a multiple of the 16-pixel patch
    cfg = ServeConfig(model_name="tiny-world", steps=1, max_video_pixels=MAX_PIXELS, generation_warmup=(refused,))
    with pytest.raises(RuntimeError, match="warm-up failed: InvalidRequest: size: .*multiples of 16"):
        with ServerThread(policy, cfg):
            pass
