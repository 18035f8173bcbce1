"""`/v1/videos` forward- and inverse-dynamics modes over loopback with httpx (vLLM-Omni `extra_params`).

FakePolicy (real generic request checks, no model) covers the protocol: round trips, shapes, every bad
input as a typed 400 followed by a good request, engine-thread execution; the embedded tiny model runs
one real FD and one real ID request end to end.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import numpy as np
import pytest
from oracle.fake_policy import FakePolicy
from PIL import Image

from wamrt.client.wire import packb, unpackb
from wamrt.serving import ServeConfig, ServerThread

ROW = 10  # droid_lerobot's raw action width in the generic (diffusers) contract


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ServerThread]:
    """One FakePolicy server for this module (the conftest one is per test; startup dominates here)."""
    with ServerThread(FakePolicy(), ServeConfig(max_batch=4, max_wait_ms=2.0)) as server:
        yield server


def _png(h: int = 48, w: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _mp4(frames: int, h: int = 48, w: int = 64) -> bytes:
    """A real H.264 MP4 written by PyAV (what a vLLM-Omni client uploads as input_reference)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=15)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for k in range(frames):
            img = np.full((h, w, 3), 10 * k, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def _fd_form(chunk: int = 8, **extra: Any) -> dict[str, str]:
    ep = {"action_mode": "forward_dynamics", "domain_name": "droid_lerobot", "raw_action_dim": ROW,
          "action": np.linspace(0, 1, chunk * ROW).reshape(chunk, ROW).tolist(), "image_size": 256, **extra}
    return {"prompt": "push the cup", "seed": "3", "num_frames": str(chunk + 1), "fps": "15",
            "extra_params": json.dumps(ep)}


def _id_form(**extra: Any) -> dict[str, str]:
    ep = {"action_mode": "inverse_dynamics", "domain_id": 8, "image_size": 256, **extra}
    return {"prompt": "push the cup", "seed": "4", "extra_params": json.dumps(ep)}


def _poll(url: str, vid: str) -> dict[str, Any]:
    for _ in range(500):
        rec = httpx.get(f"{url}/v1/videos/{vid}").json()
        if rec["status"] in ("completed", "failed"):
            return rec
        time.sleep(0.02)
    raise AssertionError("job never finished")


def _good_fd_sync(url: str) -> None:
    r = httpx.post(url + "/v1/videos/sync", data=_fd_form(), files={"input_reference": ("f.png", _png())}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert len(_frames(r.content)) == 9


def test_forward_dynamics_job_serves_an_mp4(fake_server: ServerThread) -> None:
    url = fake_server.http_url
    rec = httpx.post(url + "/v1/videos", data=_fd_form(), files={"input_reference": ("f.png", _png())}).json()
    assert rec["id"].startswith("video_gen_") and rec["status"] == "queued", rec
    done = _poll(url, rec["id"])
    assert done["status"] == "completed", done
    assert done["action"] is None  # the actions were the input (diffusers returns none either)
    assert done["file_name"] == f"{rec['id']}.mp4" and done["video"]["fps"] == 15.0
    t, h, w, c = done["video"]["shape"]
    assert t == 9 and c == 3 and h % 16 == 0 and w % 16 == 0
    assert done["metadata"] == {"seed": 3, "action_mode": "forward_dynamics", "chunk_size": 8,
                                "domain": "droid_lerobot", "resolution_tier": 256}
    assert done["inference_time_s"] > 0 and "denoise" in done["stage_durations"] and done["peak_memory_mb"] > 0
    content = httpx.get(f"{url}/v1/videos/{rec['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = _frames(content.content)
    assert frames.shape == (t, h, w, 3)
    # The fake's frame k is 8k everywhere; H.264 at crf 18 keeps that within a few levels.
    np.testing.assert_allclose(frames.reshape(t, -1).mean(1), 8 * np.arange(t), atol=3)
    assert httpx.delete(f"{url}/v1/videos/{rec['id']}").json()["deleted"] is True
    assert rec["id"] not in fake_server.app.state.video_jobs.content  # the MP4 goes with its record
    assert set(fake_server.service.policy.generic_threads) == {"wamrt-engine"}  # ran on the engine thread


def test_forward_dynamics_sync_mp4_and_json(fake_server: ServerThread) -> None:
    url = fake_server.http_url
    files = {"input_reference": ("f.png", _png())}
    r = httpx.post(url + "/v1/videos/sync", data=_fd_form(chunk=4), files=files)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert r.headers["x-request-id"].startswith("video_sync-") and float(r.headers["x-inference-time-s"]) > 0
    assert "denoise" in json.loads(r.headers["x-stage-durations"]) and float(r.headers["x-peak-memory-mb"]) > 0
    assert len(_frames(r.content)) == 5
    # JSON form (Accept: application/json), conditioning from an image_reference data URL.
    form = dict(_fd_form(chunk=4), image_reference=json.dumps(
        {"image_url": "data:image/png;base64," + base64.b64encode(_png()).decode()}))
    body = httpx.post(url + "/v1/videos/sync", data=form, headers={"accept": "application/json"}).json()
    assert body["data"][0]["action"] is None and body["video"]["shape"][0] == 5
    assert len(_frames(base64.b64decode(body["data"][0]["b64_json"]))) == 5


def test_inverse_dynamics_job_from_mp4_upload(fake_server: ServerThread) -> None:
    url = fake_server.http_url
    rec = httpx.post(url + "/v1/videos", data=_id_form(action_chunk_size=8),
                     files={"input_reference": ("v.mp4", _mp4(9), "video/mp4")}).json()
    done = _poll(url, rec["id"])
    assert done["status"] == "completed", done
    action = done["action"]
    assert action["shape"] == [8, ROW] and action["raw_action_dim"] == ROW and action["dtype"] == "float32"
    assert action["action_mode"] == "inverse_dynamics" and action["domain_id"] == 8
    np.testing.assert_array_equal(np.asarray(action["data"]), np.full((8, ROW), 0.25))
    assert done["file_name"] is None
    assert httpx.get(f"{url}/v1/videos/{rec['id']}/content").content == b""  # action-only output


def test_inverse_dynamics_sync_inline_and_data_url(fake_server: ServerThread) -> None:
    url = fake_server.http_url
    video = np.zeros((5, 32, 48, 3), np.uint8)
    inline = {"b64": base64.b64encode(video.tobytes()).decode(), "dtype": "uint8", "shape": list(video.shape)}
    r = httpx.post(url + "/v1/videos/sync", json={"prompt": "x", "extra_params": {
        "action_mode": "inverse_dynamics", "video": inline, "image_size": 256}})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["action"]["shape"] == [4, ROW] and r.json()["data"][0]["b64_json"] is None
    ref = json.dumps({"video_url": "data:video/mp4;base64," + base64.b64encode(_mp4(5)).decode()})
    r = httpx.post(url + "/v1/videos/sync", data={**_id_form(), "video_reference": ref})
    assert r.status_code == 200 and r.json()["data"][0]["action"]["shape"] == [4, ROW], r.text


def _bad_cases() -> dict[str, tuple[dict[str, str], dict[str, Any], str]]:
    """name -> (form, files, expected error field)."""
    png, mp4_9, mp4_8 = ("f.png", _png()), ("v.mp4", _mp4(9)), ("v.mp4", _mp4(8))
    nan_actions = np.zeros((8, ROW))
    nan_actions[2, 3] = np.nan
    fd_no_action = _fd_form()
    fd_no_action["extra_params"] = json.dumps({"action_mode": "forward_dynamics", "image_size": 256})
    return {
        "id_missing_video": (_id_form(), {}, "input_reference"),
        "id_image_not_video": (_id_form(), {"input_reference": png}, "input_reference"),
        "id_frames_not_chunk_plus_one": (_id_form(action_chunk_size=4), {"input_reference": mp4_9}, "input_reference"),
        "id_chunk_not_multiple_of_4": (_id_form(), {"input_reference": mp4_8}, "input_reference"),
        "id_with_actions": (_id_form(action=[[0.0] * ROW] * 8), {"input_reference": mp4_9}, "extra_params.action"),
        "id_garbage_upload": (_id_form(), {"input_reference": ("v.mp4", b"\x00\x01 not a video")}, "input_reference"),
        "id_bad_inline_video": (_id_form(video=[[1, 2], [3, 4]]), {}, "extra_params.video"),
        "fd_missing_image": (_fd_form(), {}, "input_reference"),
        "fd_missing_actions": (fd_no_action, {"input_reference": png}, "extra_params.action"),
        "fd_wrong_action_width": (_fd_form(action=[[0.0] * 8] * 8), {"input_reference": png}, "extra_params.action"),
        "fd_nan_action": (_fd_form(action=nan_actions.tolist()), {"input_reference": png}, "extra_params.action"),
        "fd_chunk_mismatch": (_fd_form(action_chunk_size=16), {"input_reference": png}, "extra_params.action"),
        "fd_num_frames_mismatch": ({**_fd_form(), "num_frames": "33"}, {"input_reference": png}, "num_frames"),
        "fd_raw_dim_mismatch": (_fd_form(raw_action_dim=8), {"input_reference": png}, "extra_params.raw_action_dim"),
        "fd_guidance_interval": (_fd_form(guidance_interval=[960, 1001]), {"input_reference": png},
                                 "extra_params.guidance_interval"),
        "bad_tier": (_fd_form(image_size=300), {"input_reference": png}, "extra_params.image_size"),
        "bad_view_point": (_fd_form(view_point="sideways"), {"input_reference": png}, "extra_params.view_point"),
        "unknown_domain": (_fd_form(domain_name="mars_rover"), {"input_reference": png}, "extra_params.domain_name"),
        "unknown_mode": (_fd_form(action_mode="backward_dynamics"), {"input_reference": png},
                         "extra_params.action_mode"),
        "bad_steps": ({**_fd_form(), "num_inference_steps": "0"}, {"input_reference": png}, "num_inference_steps"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_dynamics_requests_are_typed(fake_server: ServerThread, case: str) -> None:
    form, files, field = _bad_cases()[case]
    url = fake_server.http_url
    jobs_before = len(fake_server.app.state.video_jobs.records)
    for path in ("/v1/videos", "/v1/videos/sync"):
        r = httpx.post(url + path, data=form, files=files or None)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()
        assert err["type"] == "error" and err["code"] == "invalid_request" and err["field"] == field, err
    assert len(fake_server.app.state.video_jobs.records) == jobs_before  # refused before any job record exists
    _good_fd_sync(url)


def test_dynamics_jobs_share_the_queue_but_never_a_batch(obs: dict[str, Any]) -> None:
    """FD/ID run alone on the engine thread, through the bounded queue (busy -> 429), next to policy lanes."""
    policy = FakePolicy(delay=0.1)
    with ServerThread(policy, ServeConfig(max_batch=4, max_wait_ms=30, max_queue=3)) as server:
        url = server.http_url
        results: list[int] = []

        def policy_call() -> None:
            r = httpx.post(url + "/v1/policy/infer", content=packb(obs),
                           headers={"content-type": "application/msgpack"}, timeout=30)
            results.append(r.status_code)

        threads = [threading.Thread(target=policy_call) for _ in range(3)]
        for t in threads:
            t.start()
        r = httpx.post(url + "/v1/videos/sync", data=_fd_form(), files={"input_reference": ("f.png", _png())},
                       timeout=30)
        for t in threads:
            t.join(30)
        assert r.status_code in (200, 429), r.text
        assert results.count(200) + results.count(429) == 3
        assert max(policy.calls) <= 4 and policy.max_active == 1  # one engine thread, never two calls at once
        assert set(policy.generic_threads) <= {"wamrt-engine"}
        # Fill the queue behind a slow engine: FD jobs beyond max_queue get a typed busy error.
        policy.delay = 0.3
        form, png = _fd_form(), _png()
        replies: list[httpx.Response] = []

        def job() -> None:
            replies.append(httpx.post(url + "/v1/videos", data=form, files={"input_reference": ("f.png", png)}))

        threads = [threading.Thread(target=job) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        codes = sorted(r.status_code for r in replies)
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
        assert {r.json()["code"] for r in replies if r.status_code == 429} == {"busy"}
        deadline = time.monotonic() + 10
        while server.service.batcher.depth and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.batcher.depth == 0
        assert unpackb(httpx.post(url + "/v1/policy/infer", content=packb(obs),
                                  headers={"content-type": "application/msgpack"}).content)["actions"].shape == (32, 8)


def test_tiny_model_forward_and_inverse_dynamics(tiny_server: Any) -> None:
    """The real embedded model end to end (steps=1, 256 tier, 32x32 input, chunk 4)."""
    url = tiny_server.http_url
    r = httpx.post(url + "/v1/videos/sync", data=_fd_form(chunk=4), files={"input_reference": ("f.png", _png(32, 32))},
                   timeout=300)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    frames = _frames(r.content)
    assert frames.shape == (5, 32, 32, 3) and frames.std() > 0
    r = httpx.post(url + "/v1/videos/sync", data=_id_form(), files={"input_reference": ("v.mp4", _mp4(5, 32, 32))},
                   timeout=300)
    assert r.status_code == 200, r.text
    action = r.json()["data"][0]["action"]
    assert action["shape"] == [4, ROW] and action["action_mode"] == "inverse_dynamics"
    assert np.isfinite(np.asarray(action["data"])).all()
    assert r.json()["metadata"]["seed"] == 4


def test_without_pyav_mp4_requests_get_a_501_and_policies_are_served(fake_server: ServerThread, obs: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A server started without PyAV (the server extra installs it; `wamrt serve` no longer requires it) refuses
    # what reads or writes MP4 before any job exists, says so in its metadata, and serves policies as before.
    from wamrt.serving import media

    url = fake_server.http_url
    monkeypatch.setattr(media, "has_pyav", lambda: False)
    assert httpx.get(url + "/v1/metadata").json()["mp4"] is False
    jobs_before = len(fake_server.app.state.video_jobs.records)
    cases = {"extra_params.action_mode": (_fd_form(), {"input_reference": ("f.png", _png())}),
             "prompt": ({"prompt": "a robot arm stacks cups", "size": "64x48"}, None)}
    for field, (form, files) in cases.items():
        for path in ("/v1/videos", "/v1/videos/sync"):
            r = httpx.post(url + path, data=form, files=files)
            assert r.status_code == 501, (path, r.status_code, r.text)
            err = r.json()
            assert err["code"] == "not_available" and err["field"] == field and "PyAV" in err["message"], err
    assert len(fake_server.app.state.video_jobs.records) == jobs_before
    r = httpx.post(url + "/v1/policy/infer", content=packb(obs), headers={"content-type": "application/msgpack"},
                   timeout=30)
    assert r.status_code == 200 and unpackb(r.content)["actions"].shape[0] > 0
    monkeypatch.undo()
    assert httpx.get(url + "/v1/metadata").json()["mp4"] is True
    _good_fd_sync(url)
