"""`POST /v1/policy/infer` + probes over loopback with httpx: round trips and one test per bad input."""

from __future__ import annotations

import base64
import json
import math
import time
from typing import Any

import httpx
import numpy as np
import pytest
from oracle.fake_policy import FakePolicy

from wamrt.client.wire import packb, unpackb
from wamrt.serving import ServeConfig, ServerThread

MSGPACK = {"content-type": "application/msgpack"}


def _json_obs(obs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obs.items():
        if isinstance(v, np.ndarray) and v.dtype == np.uint8:
            out[k] = {"b64": base64.b64encode(v.tobytes()).decode(), "dtype": "uint8", "shape": list(v.shape)}
        elif isinstance(v, np.ndarray | np.generic):
            out[k] = v.tolist()
        else:
            out[k] = v
    return out


def _ok(url: str, obs: dict[str, Any]) -> None:
    r = httpx.post(url + "/v1/policy/infer", content=packb(obs), headers=MSGPACK, timeout=30)
    assert r.status_code == 200, r.text
    assert unpackb(r.content)["actions"].shape == (32, 8)


def test_msgpack_round_trip(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", content=packb(obs), headers=MSGPACK)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    body = unpackb(r.content)
    assert body["actions"].dtype == np.float32 and body["actions"].shape == (32, 8)
    assert set(body["timing"]) >= {"queue_ms", "preprocess_ms", "model_ms", "postprocess_ms", "total_ms"}
    assert body["request_id"] == r.headers["x-request-id"]
    assert float(r.headers["x-inference-time-s"]) > 0


def test_json_round_trip_and_png(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    import io

    from PIL import Image

    body = _json_obs(obs)
    buf = io.BytesIO()
    Image.fromarray(obs["observation/wrist_image_left"]).save(buf, format="PNG")
    body["observation/wrist_image_left"] = {"b64": base64.b64encode(buf.getvalue()).decode()}
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert np.asarray(out["actions"]).shape == (32, 8)
    assert out["metadata"]["horizon"] == 32


def test_metadata_and_probes(fake_server: ServerThread) -> None:
    url = fake_server.http_url
    meta = httpx.get(url + "/v1/policy/metadata").json()
    assert meta["action_horizon"] == 32 and meta["image_resolution"] == [360, 640]
    assert meta["needs_session_id"] is True and meta["n_external_cameras"] == 2
    assert unpackb(httpx.get(url + "/v1/policy/metadata", headers={"accept": "application/msgpack"}).content) == meta
    assert httpx.get(url + "/healthz").text == "OK\n"
    assert httpx.get(url + "/readyz").json()["ready"] is True
    text = httpx.get(url + "/metrics").text
    for name in ("wamrt_queue_depth", "wamrt_batch_size", "wamrt_request_seconds", "wamrt_stage_seconds",
                 "wamrt_errors_total"):
        assert name in text


def _bad_cases(obs: dict[str, Any]) -> dict[str, tuple[bytes, str]]:
    nan = dict(obs, **{"observation/joint_position": np.full(7, np.nan, np.float32)})
    inf = dict(obs, **{"observation/gripper_position": np.float32(math.inf)})
    no_prompt = {k: v for k, v in obs.items() if k != "prompt"}
    return {
        "malformed_msgpack": (b"\xc1\xff\x00garbage", ""),
        "truncated_msgpack": (packb(obs)[:1000], ""),
        "wrong_image_shape": (packb(dict(obs, **{"observation/wrist_image_left": np.zeros((10, 10), np.uint8)})),
                              "observation/wrist_image_left"),
        "wrong_image_dtype": (packb(dict(obs, **{"observation/wrist_image_left": {
            b"__ndarray__": True, b"data": bytes(8 * 8 * 3 * 8), b"dtype": "<c8", b"shape": [8, 8, 3]}})), ""),
        "bool_image": (packb(dict(obs, **{"observation/exterior_image_1_left": np.zeros((8, 8, 3), bool)})),
                       "observation/exterior_image_1_left"),
        "nan_state": (packb(nan), "observation/joint_position"),
        "inf_gripper": (packb(inf), "observation/gripper_position"),
        "missing_prompt": (packb(no_prompt), "prompt"),
        # An unknown key is noted, not refused (openpi clients send extra keys); a misspelled required one is missing.
        "misspelled_key": (packb({("observation/joint_positon" if k == "observation/joint_position" else k): v
                                  for k, v in obs.items()}), "observation/joint_position"),
        "not_a_map": (packb([1, 2, 3]), ""),
        "bad_params": (packb(dict(obs, params={"num_steps": 0})), "params.steps"),
    }


@pytest.mark.parametrize("case", list(_bad_cases({"prompt": "x"}).keys()))
def test_bad_input_is_typed_and_server_keeps_serving(fake_server: ServerThread, obs: dict[str, Any],
                                                     case: str) -> None:
    payload, field = _bad_cases(obs)[case]
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", content=payload, headers=MSGPACK)
    assert r.status_code == 400, r.content
    err = unpackb(r.content)
    assert err["type"] == "error" and err["code"] == "invalid_request"
    if field:
        assert err["field"] == field
    _ok(fake_server.http_url, obs)


def test_malformed_json(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", content=b"{nope", headers={"content-type":
                                                                                           "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request"
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", content=b"x", headers={"content-type": "text/csv"})
    assert r.status_code == 415 and r.json()["code"] == "unsupported_media_type"
    _ok(fake_server.http_url, obs)


def test_oversize_body_and_api_key(obs: dict[str, Any]) -> None:
    cfg = ServeConfig(api_key="s3cret", max_frame_bytes=2 * 2**20)
    with ServerThread(FakePolicy(), cfg) as server:
        url = server.http_url + "/v1/policy/infer"
        auth = {**MSGPACK, "authorization": "Bearer s3cret"}
        big = dict(obs, **{"observation/image": np.zeros((1200, 1200, 3), np.uint8)})
        r = httpx.post(url, content=packb(big), headers=auth)
        assert r.status_code == 413 and unpackb(r.content)["code"] == "payload_too_large"
        for headers in (MSGPACK, {**MSGPACK, "authorization": "Bearer wrong"}, {**MSGPACK, "api-key": "nope"}):
            r = httpx.post(url, content=packb(obs), headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthorized"
        assert httpx.get(server.http_url + "/healthz").status_code == 200  # probes stay open
        assert httpx.get(server.http_url + "/metrics").status_code == 401
        for good in ({"authorization": "Bearer s3cret"}, {"authorization": "Api-Key s3cret"}, {"api-key": "s3cret"}):
            r = httpx.post(url, content=packb(obs), headers={**MSGPACK, **good})
            assert r.status_code == 200
        assert 'wamrt_errors_total{code="unauthorized"} 4.0' in httpx.get(
            server.http_url + "/metrics", headers=auth).text


def test_stale_observation_rejected(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    old = dict(obs, timestamp=time.time() - 5.0, max_age_ms=100)
    r = httpx.post(fake_server.http_url + "/v1/policy/infer", content=packb(old), headers=MSGPACK)
    assert r.status_code == 422 and unpackb(r.content)["code"] == "stale"
    fresh = dict(obs, timestamp=time.time(), max_age_ms=10_000)
    _ok(fake_server.http_url, fresh)


def test_client_disconnect_leaves_no_stuck_job(obs: dict[str, Any]) -> None:
    # The engine call (1 s) outlasts all four clients (4 x 0.15 s): only the first request ever starts,
    # the other three are dropped from the queue (one slot of slack for a slow disconnect under load).
    policy = FakePolicy(delay=1.0)
    with ServerThread(policy, ServeConfig(max_batch=1, max_wait_ms=0)) as server:
        url = server.http_url + "/v1/policy/infer"
        for _ in range(4):  # first rides the engine, the others wait in the queue; all hang up
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url, content=packb(obs), headers=MSGPACK, timeout=0.15)
        deadline = time.monotonic() + 5
        while (server.service.batcher.depth or server.service.batcher.in_flight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.batcher.depth == 0 and server.service.batcher.in_flight == 0
        calls_before = len(policy.calls)
        _ok(server.http_url, obs)
        assert len(policy.calls) == calls_before + 1
        # The abandoned requests never all ran: at most the ones already taken by the engine did.
        assert calls_before <= 1 + 2  # warm-up + the first (+ at most one whose hang-up landed late)
    assert json.dumps(server.service.handshake())  # handshake stays JSON-serialisable
