"""End to end against the real embedded tiny model (steps=1): one round trip per surface."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from wamrt.client import PolicyClient
from wamrt.client.wire import to_jsonable

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")


def test_openpi_client_and_vllm_path(tiny_server: Any, obs: dict[str, Any]) -> None:
    client = WebsocketClientPolicy(tiny_server.ws_url)
    meta = client.get_server_metadata()
    assert meta["model"] == "tiny-droid" and meta["sampler"]["num_steps"] == 1
    out = client.infer({**obs, "seed": 5, "session_id": "ep0"})
    assert out["actions"].shape == (32, 8) and np.isfinite(out["actions"]).all()
    assert out["metadata"]["seed"] == 5 and out["metadata"]["session_id"] == "ep0"
    assert out["timing"]["server_policy_inference_ms"] > 0
    with PolicyClient(tiny_server.ws_url + "/v1/realtime/robot/openpi") as c:
        bare = c.infer({**obs, "seed": 5})
    np.testing.assert_array_equal(bare, out["actions"])  # same seed, same engine -> same chunk


def test_http_json(tiny_server: Any, obs: dict[str, Any]) -> None:
    body = json.loads(json.dumps(to_jsonable({**obs, "seed": 1})))
    r = httpx.post(tiny_server.http_url + "/v1/policy/infer", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert np.asarray(r.json()["actions"]).shape == (32, 8)
    metrics = httpx.get(tiny_server.http_url + "/metrics").text
    assert 'wamrt_requests_total{surface="http"}' in metrics


def test_remaining_surfaces_and_reset(tiny_server: Any, obs: dict[str, Any]) -> None:
    """RoboArena dialect + reset (websockets), msgpack /v1/policy/infer + metadata, a /v1/videos policy job."""
    import time

    from openpi_client import msgpack_numpy as openpi_msgpack
    from websockets.sync.client import connect

    from wamrt.client.wire import packb, unpackb

    url = tiny_server.http_url
    obs = {k: (v[::4, ::4] if k.endswith("_left") else v) for k, v in obs.items()}  # smaller JSON; same canvas
    with connect(tiny_server.ws_url, max_size=None) as ws:
        assert openpi_msgpack.unpackb(ws.recv())["action_horizon"] == 32
        ws.send(openpi_msgpack.packb({**obs, "endpoint": "infer", "session_id": "e1", "seed": 2}))
        bare = openpi_msgpack.unpackb(ws.recv())
        assert bare.shape == (32, 8) and bare.dtype == np.float32 and np.isfinite(bare).all()
        ws.send(openpi_msgpack.packb({"endpoint": "reset"}))
        assert ws.recv() == "reset successful"
    r = httpx.post(url + "/v1/policy/infer", content=packb({**obs, "seed": 2}),
                   headers={"content-type": "application/msgpack"}, timeout=120)
    assert r.status_code == 200
    np.testing.assert_array_equal(unpackb(r.content)["actions"], bare)  # same seed, same chunk on every surface
    assert httpx.get(url + "/v1/policy/metadata").json()["sampler"]["num_steps"] == 1
    robot = {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in obs.items()}
    rec = httpx.post(url + "/v1/videos", json={"prompt": obs["prompt"], "seed": 2,
                                               "extra_params": {"robot_obs": robot}}).json()
    for _ in range(600):
        rec = httpx.get(f"{url}/v1/videos/{rec['id']}").json()
        if rec["status"] in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert rec["status"] == "completed", rec
    np.testing.assert_allclose(np.asarray(rec["action"]["data"], np.float32), bare, rtol=0, atol=1e-6)
