"""One observation contract: the same dicts fed to the library (`Policy.infer`) and to every server surface
(openpi websocket through the official openpi-client, `/v1/policy/infer`, a `/v1/videos` policy job) get the same
outcome -- the same actions and notes, or an error naming the same field."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from oracle.generation_jobs import poll_job

from wamrt import RequestError
from wamrt.client.wire import packb, unpackb
from wamrt.pipeline.observation import EXT2, OPTIONAL_KEYS, check_observation
from wamrt.sample import sample_observation

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
JOINTS = "observation/joint_position"


def _small() -> dict[str, Any]:
    # A quarter of the views' size: the same canvas after the resize, a quarter of the bytes.
    return {k: (v[::4, ::4] if k.endswith("_left") else v) for k, v in sample_observation(0).items()}


def _renamed(obs: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {(new if k == old else k): v for k, v in obs.items()}


OK_CASES = {
    "complete": lambda o: o,
    "missing_optional_view": lambda o: {k: v for k, v in o.items() if k != EXT2},
    "unknown_extra_key": lambda o: {**o, "observation/joint_velocity": np.zeros(7, np.float32)},
}
BAD_CASES = {  # name -> (observation, the field every surface names)
    "misspelled_key": (lambda o: _renamed(o, JOINTS, "observation/joint_positon"), JOINTS),
    "wrong_shape": (lambda o: {**o, "observation/wrist_image_left": np.zeros((8, 8), np.uint8)},
                    "observation/wrist_image_left"),
    "wrong_state_shape": (lambda o: {**o, JOINTS: np.zeros(6, np.float32)}, JOINTS),
    "missing_required_view": (lambda o: {k: v for k, v in o.items() if k != "observation/exterior_image_1_left"},
                              "observation/exterior_image_1_left"),
}


def _videos_job(url: str, obs: dict[str, Any], seed: int) -> dict[str, Any]:
    robot = {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in obs.items()}
    r = httpx.post(url + "/v1/videos", json={"prompt": obs.get("prompt", "x"), "seed": seed,
                                             "extra_params": {"robot_obs": robot}}, timeout=60)
    if r.status_code != 200:
        return {"status": "rejected", "error": r.json()}
    return poll_job(url, r.json()["id"], timeout=120.0)


@pytest.mark.parametrize("case", list(OK_CASES))
def test_accepted_observations_agree(tiny_server: Any, tiny_policy: Any, case: str) -> None:
    obs = OK_CASES[case](_small())
    chunk = tiny_policy.infer(obs, seed=3, steps=1)
    ws = WebsocketClientPolicy(tiny_server.ws_url).infer({**obs, "seed": 3})
    http = unpackb(httpx.post(tiny_server.http_url + "/v1/policy/infer", content=packb({**obs, "seed": 3}),
                              headers={"content-type": "application/msgpack"}, timeout=120).content)
    for reply in (ws, http):
        np.testing.assert_array_equal(reply["actions"], chunk.actions)
        assert reply["metadata"].get("notes", []) == chunk.notes
    if case == "missing_optional_view":
        assert chunk.notes == [f"{EXT2} {OPTIONAL_KEYS[EXT2].note}"]
        rec = _videos_job(tiny_server.http_url, obs, seed=3)
        assert rec["status"] == "completed", rec
        np.testing.assert_allclose(np.asarray(rec["action"]["data"], np.float32), chunk.actions, rtol=0, atol=1e-6)
        assert rec["metadata"]["notes"] == chunk.notes
    elif case == "unknown_extra_key":
        assert chunk.notes == ["'observation/joint_velocity' is not an observation key: ignored "
                               "(did you mean 'observation/joint_position'?)"]
    else:
        assert chunk.notes == []


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_refused_observations_name_the_same_field(tiny_server: Any, tiny_policy: Any, case: str) -> None:
    make, field = BAD_CASES[case]
    obs = make(_small())
    with pytest.raises(RequestError) as lib:
        tiny_policy.infer(obs, seed=0, steps=1)
    assert lib.value.field == field
    r = httpx.post(tiny_server.http_url + "/v1/policy/infer", content=packb(obs),
                   headers={"content-type": "application/msgpack"}, timeout=60)
    assert r.status_code == 400 and unpackb(r.content)["field"] == field
    assert unpackb(r.content)["message"] == lib.value.message  # one message, from one function
    client = WebsocketClientPolicy(tiny_server.ws_url)
    client._ws.send(packb(obs))
    import json

    assert json.loads(client._ws.recv())["field"] == field
    rec = _videos_job(tiny_server.http_url, obs, seed=0)
    assert rec["status"] == "rejected" and rec["error"]["field"] == field, rec
    if case == "misspelled_key":
        assert "did you mean 'observation/joint_position'" in lib.value.message


def test_contract_table_and_defaults() -> None:
    """The optional-key table drives defaults; the composite view needs no second exterior."""
    obs = _small()
    del obs[EXT2]
    checked = check_observation(obs)
    assert checked.observation[EXT2].shape == obs["observation/exterior_image_1_left"].shape
    assert not checked.observation[EXT2].any() and checked.notes == [f"{EXT2} {OPTIONAL_KEYS[EXT2].note}"]
    composite = {"prompt": "go", "observation/image": np.full((60, 80, 3), 0.5, np.float32),
                 JOINTS: np.zeros(7), "observation/gripper_position": 0.0}
    checked = check_observation(composite)
    assert EXT2 not in checked.observation and checked.notes == []
    assert checked.observation["observation/image"].dtype == np.uint8  # float [0, 1] scaled, as openpi does
    assert int(checked.observation["observation/image"][0, 0, 0]) == 127
    again = check_observation(checked.observation)  # idempotent: the server's output is the policy's input
    np.testing.assert_array_equal(again.observation["observation/image"], checked.observation["observation/image"])
    with pytest.raises(RequestError, match="non-empty") as err:
        check_observation({**composite, "prompt": " "})
    assert err.value.field == "prompt"
