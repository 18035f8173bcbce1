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
