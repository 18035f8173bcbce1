"""openpi websocket over loopback: the PyPI openpi-client, plain `websockets`, every dialect and marker."""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import pytest
import websockets
from openpi_client import msgpack_numpy as openpi_msgpack
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from oracle.fake_policy import FakePolicy
from websockets.sync.client import connect

from wamrt.client import PolicyClient, ServerError
from wamrt.client.wire import packb, unpackb
from wamrt.serving import ServeConfig, ServerThread

VLLM = "/v1/realtime/robot/openpi"
# openpi-client 0.1.2 opens its socket outside `with`; websockets 17 warns about that, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")


def test_openpi_client_round_trip(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    client = WebsocketClientPolicy(fake_server.ws_url)
    meta = client.get_server_metadata()
    assert meta["action_horizon"] == 32 and meta["action_space"] == "joint_position"
    out = client.infer(obs)
    assert out["actions"].shape == (32, 8) and out["actions"].dtype == np.float32
    np.testing.assert_array_equal(out["actions"], out["action"])
    assert set(out["server_timing"]) == {"infer_ms", "prev_total_ms"}
    assert out["server_timing"]["prev_total_ms"] is None
    assert set(out["timing"]) >= {"server_preprocess_ms", "server_policy_inference_ms", "server_postprocess_ms",
                                  "server_total_ms", "queue_ms"}
    out2 = client.infer(obs)
    assert out2["server_timing"]["prev_total_ms"] > 0
    assert out["metadata"]["reset"] is True and out2["metadata"]["reset"] is False
    client.reset()  # openpi-client: a no-op


def test_openpi_style_single_exterior_and_composite(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    client = WebsocketClientPolicy(fake_server.ws_url)
    droid = {k: v for k, v in obs.items() if k != "observation/exterior_image_2_left"}
    out = client.infer(droid)
    assert out["actions"].shape == (32, 8) and "zero-filled" in out["metadata"]["notes"][0]
    composite = {"prompt": obs["prompt"], "observation/image": np.zeros((540, 640, 3), np.uint8),
                 "observation/joint_position": obs["observation/joint_position"][None].repeat(3, 0),
                 "observation/gripper_position": np.array([0.2, 0.3, 0.4], np.float32)}
    assert client.infer(composite)["actions"].shape == (32, 8)
    chw_float = dict(obs, **{"observation/wrist_image_left": np.random.rand(3, 360, 640).astype(np.float32)})
    assert client.infer(chw_float)["actions"].shape == (32, 8)


def test_roboarena_dialect(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    with connect(fake_server.ws_url, max_size=None) as ws:
        assert "image_resolution" in openpi_msgpack.unpackb(ws.recv())
        ws.send(openpi_msgpack.packb({**obs, "endpoint": "infer", "session_id": "ep-1"}))
        reply = openpi_msgpack.unpackb(ws.recv())
        assert isinstance(reply, np.ndarray) and reply.shape == (32, 8) and reply.dtype == np.float32
        ws.send(openpi_msgpack.packb({"endpoint": "reset"}))
        assert ws.recv() == "reset successful"


def test_vllm_omni_path(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    with connect(fake_server.ws_url + VLLM, max_size=None) as ws:
        assert openpi_msgpack.unpackb(ws.recv())["needs_session_id"] is True
        ws.send(openpi_msgpack.packb({**obs, "session_id": "s1", "seed": 3}))
        assert openpi_msgpack.unpackb(ws.recv()).shape == (32, 8)  # bare array by default
        ws.send(openpi_msgpack.packb({**obs, "params": {"structured": True}}))
        structured = openpi_msgpack.unpackb(ws.recv())
        assert structured["actions"].shape == (32, 8) and structured["metadata"]["session_id"] == "s1"
        ws.send(openpi_msgpack.packb({**obs, "session_id": "s2"}))
        ws.recv()
        ws.send(openpi_msgpack.packb({"endpoint": "reset"}))
        assert openpi_msgpack.unpackb(ws.recv()) == {"status": "reset successful"}
        ws.send(b"\xc1 not msgpack")  # vLLM path: msgpack error map, socket stays open
        err = openpi_msgpack.unpackb(ws.recv())
        assert err["type"] == "error" and err["code"] == "invalid_request"
        ws.send(openpi_msgpack.packb(obs))
        assert openpi_msgpack.unpackb(ws.recv()).shape == (32, 8)


def test_session_change_marks_reset(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    with PolicyClient(fake_server.ws_url) as c:
        flags = [c.infer({**obs, "session_id": sid})["metadata"]["reset"] for sid in ("a", "a", "b", "b")]
        assert flags == [True, False, True, False]
        c._ws.send(packb({**obs, "reset": True}))  # in-band reset flag
        assert unpackb(c._ws.recv())["metadata"]["reset"] is True


@pytest.mark.parametrize("marker", ["openpi", "msgpack_numpy", "vllm"])
def test_all_numpy_markers(fake_server: ServerThread, obs: dict[str, Any], marker: str) -> None:
    if marker == "openpi":
        blob = openpi_msgpack.packb(obs)
    elif marker == "msgpack_numpy":
        blob = msgpack.packb(obs, default=msgpack_numpy.encode)
    else:
        native = {k: ({"nd": True, "type": v.dtype.str, "kind": "", "shape": list(v.shape), "data": v.tobytes()}
                      if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else v)
                  for k, v in obs.items()}
        blob = msgpack.packb(native)
    with connect(fake_server.ws_url, max_size=None) as ws:
        ws.recv()
        ws.send(blob)
        assert openpi_msgpack.unpackb(ws.recv())["actions"].shape == (32, 8)


def _bad(obs: dict[str, Any]) -> dict[str, Any]:
    no_prompt = {k: v for k, v in obs.items() if k != "prompt"}
    return {
        "malformed": b"\x92\x01",  # array of 2 with only one element
        "text_frame": "hello",
        "image_shape": packb(dict(obs, **{"observation/wrist_image_left": np.zeros((5, 5, 4), np.uint8)})),
        "image_dtype": openpi_msgpack.packb(
            dict(obs, **{"observation/wrist_image_left": np.array(["a"] * 3)[None, None]})),
        "nan_state": packb(dict(obs, **{"observation/joint_position": np.full(7, np.nan, np.float32)})),
        "inf_state": packb(dict(obs, **{"observation/gripper_position": np.float64(math.inf)})),
        "missing_prompt": packb(no_prompt),
        "misspelled_key": packb({("observation/gripper_positon" if k == "observation/gripper_position" else k): v
                                 for k, v in obs.items()}),
        "stale": packb(dict(obs, timestamp=time.time() - 60, max_age_ms=50)),
    }


@pytest.mark.parametrize("case", list(_bad({"prompt": "p"})))
def test_bad_input_same_socket_survives(fake_server: ServerThread, obs: dict[str, Any], case: str) -> None:
    """openpi-client raises on the text error frame; the same socket then serves the next request."""
    client = WebsocketClientPolicy(fake_server.ws_url)
    payload = _bad(obs)[case]
    client._ws.send(payload)
    reply = client._ws.recv()
    assert isinstance(reply, str)
    err = json.loads(reply)
    assert err["type"] == "error" and err["code"] == ("stale" if case == "stale" else "invalid_request")
    assert client.infer(obs)["actions"].shape == (32, 8)


def test_oversize_frame_closes_only_that_socket(obs: dict[str, Any]) -> None:
    with ServerThread(FakePolicy(), ServeConfig(max_frame_bytes=2**20)) as server:
        with connect(server.ws_url, max_size=None) as ws:
            ws.recv()
            ws.send(packb(dict(obs, **{"observation/image": np.zeros((1000, 1000, 3), np.uint8)})))
            with pytest.raises(websockets.ConnectionClosed) as info:
                ws.recv()
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        assert WebsocketClientPolicy(server.ws_url).infer(obs)["actions"].shape == (32, 8)


def test_api_key_on_socket(obs: dict[str, Any]) -> None:
    with ServerThread(FakePolicy(), ServeConfig(api_key="k1")) as server:
        assert WebsocketClientPolicy(server.ws_url, api_key="k1").infer(obs)["actions"].shape == (32, 8)
        with PolicyClient(server.ws_url + VLLM, api_key="k1") as c:  # Bearer
            assert c.infer(obs).shape == (32, 8)
        for key in (None, "wrong"):
            with pytest.raises(websockets.InvalidStatus) as info:
                WebsocketClientPolicy(server.ws_url, api_key=key)
            assert info.value.response.status_code == 401
            assert json.loads(info.value.response.body)["code"] == "unauthorized"


def test_disconnect_mid_request_drops_job(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.4)
    with ServerThread(policy, ServeConfig(max_batch=1, max_wait_ms=0)) as server:
        sockets = []
        stack = ExitStack()
        for _ in range(4):
            ws = stack.enter_context(connect(server.ws_url, max_size=None))
            ws.recv()
            ws.send(packb(obs))
            sockets.append(ws)
        time.sleep(0.1)
        stack.close()
        deadline = time.monotonic() + 5
        while (server.service.batcher.depth or server.service.batcher.in_flight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.batcher.depth == 0
        calls = len(policy.calls)
        assert calls <= 3  # warm-up + the one running (+ at most one taken before its close landed)
        with PolicyClient(server.ws_url) as c:
            assert c.infer(obs)["actions"].shape == (32, 8)


def test_policy_client_errors_are_typed(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    with PolicyClient(fake_server.ws_url + VLLM) as c:
        with pytest.raises(ServerError) as info:
            c.infer({"prompt": "x"})
        assert info.value.code == "invalid_request"
        assert c.reset() == {"status": "reset successful"}
        assert c.infer(obs).shape == (32, 8)
