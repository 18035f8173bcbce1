"""`action_prefix` on every surface of a real (tiny, steps=1) server: the reply starts with the committed rows, the
same chunk everywhere for the same seed, and a bad prefix is a typed 400 naming the field."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from wamrt.client.wire import to_jsonable

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")

PREFIX_TOL = 1e-5
PREFIX = (np.arange(40, dtype=np.float32).reshape(5, 8) / 40.0 - 0.5)  # d = 5 committed rows, robot space


def _small(obs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v[::4, ::4] if k.endswith("_left") else v) for k, v in obs.items()}  # smaller JSON; same canvas


def _video_job(url: str, body: dict[str, Any]) -> dict[str, Any]:
    rec = httpx.post(url + "/v1/videos", json=body, timeout=60).json()
    for _ in range(600):
        rec = httpx.get(f"{url}/v1/videos/{rec['id']}").json()
        if rec["status"] in ("completed", "failed"):
            break
        time.sleep(0.05)
    return rec


def test_prefix_on_every_surface(tiny_server: Any, obs: dict[str, Any]) -> None:
    obs = _small(obs)
    client = WebsocketClientPolicy(tiny_server.ws_url)
    assert client.get_server_metadata()["policy"]["action_prefix"]["auto"] == "inpaint"
    out = client.infer({**obs, "seed": 7, "action_prefix": PREFIX})
    ws = out["actions"]
    assert np.abs(ws[:5] - PREFIX).max() <= PREFIX_TOL
    assert out["metadata"]["action_prefix"] == {"rows": 5, "mode": "inpaint"}
    plain = client.infer({**obs, "seed": 7})["actions"]
    assert np.abs(plain[:5] - PREFIX).max() > 1e-2 and "action_prefix" not in client.infer({**obs, "seed": 7})[
        "metadata"]

    body = json.loads(json.dumps(to_jsonable({**obs, "seed": 7, "action_prefix": PREFIX})))
    r = httpx.post(tiny_server.http_url + "/v1/policy/infer", json=body, timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.asarray(r.json()["actions"], np.float32), ws, rtol=0, atol=1e-6)
    # RTC guidance needs a backward pass: this CPU server runs the eager reference, which accepts it (a CUDA
    # server's engine refuses it with a 400 naming the field, and leaves it out of its metadata).
    assert "guided" in client.get_server_metadata()["policy"]["action_prefix"]["modes"]
    guided = client.infer({**obs, "seed": 7, "action_prefix": PREFIX, "action_prefix_mode": "guided"})
    assert np.abs(guided["actions"][:5] - PREFIX).max() <= PREFIX_TOL
    assert guided["metadata"]["action_prefix"] == {"rows": 5, "mode": "guided"}

    robot = {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in obs.items()}
    rec = _video_job(tiny_server.http_url, {"prompt": obs["prompt"], "seed": 7, "extra_params": {
        "robot_obs": robot, "action_prefix": PREFIX.tolist(), "action_prefix_mode": "inpaint"}})
    assert rec["status"] == "completed", rec
    np.testing.assert_allclose(np.asarray(rec["action"]["data"], np.float32), ws, rtol=0, atol=1e-6)


@pytest.mark.parametrize("prefix, mode, field", [
    (np.zeros((17, 8), np.float32), None, "action_prefix"),
    (np.zeros((3, 7), np.float32), None, "action_prefix"),
    (np.full((3, 8), np.nan, np.float32), None, "action_prefix"),
    (np.zeros((3, 8), np.float32), "soft", "action_prefix_mode"),
])
def test_bad_prefix_is_a_typed_400_on_each_surface(tiny_server: Any, obs: dict[str, Any], prefix, mode, field):
    obs = _small(obs)
    extra = {"action_prefix": prefix, **({"action_prefix_mode": mode} if mode else {})}

    def post(path: str, body: dict[str, Any]) -> httpx.Response:  # NaN as JSON's common extension (Python reads it)
        return httpx.post(tiny_server.http_url + path, content=json.dumps(to_jsonable(body), allow_nan=True),
                          headers={"content-type": "application/json"}, timeout=60)

    r = post("/v1/policy/infer", {**obs, **extra})
    assert r.status_code == 400 and r.json()["field"] == field, r.text
    robot = {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in obs.items()}
    r = post("/v1/videos", {"prompt": obs["prompt"], "extra_params": {"robot_obs": robot, **extra}})
    assert r.status_code == 400 and r.json()["field"] == f"extra_params.{field}", r.text
