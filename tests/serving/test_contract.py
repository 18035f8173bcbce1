"""Issue-5 contract items not covered elsewhere: `wamrt serve` defaults, /readyz before warm-up, HTTP
reset, RoboArena errors on a live socket, recovery after a wrong API key and after bad /v1/videos
requests, and property-based tests of the observation and /v1/videos form decoders."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy as openpi_msgpack
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from oracle.fake_policy import FakePolicy
from websockets.sync.client import connect

from wamrt.cli import build_parser
from wamrt.client.wire import WireError, packb, unpackb
from wamrt.pipeline.errors import RequestError
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.dynamics import build_dynamics
from wamrt.serving.errors import ServingError
from wamrt.serving.observation import parse_request
from wamrt.serving.server import config_from_args

MSGPACK = {"content-type": "application/msgpack"}
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")


def test_serve_defaults_match_the_issue() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.api_key) == ("tiny-droid", "127.0.0.1", 8000, None)
    assert (args.max_batch, args.max_wait_ms, args.max_queue, args.warmup) == (None, 5.0, 64, 1)  # None: planned
    cfg = config_from_args(args)
    assert cfg.max_batch == 8 and cfg.gpu_memory_gib is None and cfg.max_prompt_tokens == 384  # 8 without a plan
    assert cfg.capture_on_request is False  # no request waits for a CUDA graph capture (issue 40)
    assert cfg.sampler_defaults() == {}  # the policy's own: 4 steps, guidance 3.0, shift 5.0 (+ Edge interval)
    assert cfg.safety_file is None and cfg.max_frame_bytes == 64 * 2**20 and cfg.prompt_bucket == 64
    args = build_parser().parse_args(["serve", "--api-key", "k", "--max-batch", "2", "--max-wait-ms", "1.5",
                                      "--max-queue", "9", "--steps", "2", "--guidance", "1.5", "--shift", "4",
                                      "--guidance-interval", "960", "1001", "--port", "8123", "--prompt-bucket", "32"])
    cfg = config_from_args(args)
    assert cfg.prompt_bucket == 32
    assert cfg.engine_settings("cuda:0") == {"attention": "cudnn", "epilogues": "inductor", "prompt_bucket": 32,
                                             "prompt_width": 0, "isolate_requests": False,
                                             "capture_on_request": False}  # engine defaults else
    assert cfg.engine_settings("cpu") == {"attention": "auto", "compile": False, "cuda_graph": False,
                                          "prompt_bucket": 32, "prompt_width": 0, "isolate_requests": False,
                                          "capture_on_request": False}
    invariant = config_from_args(build_parser().parse_args(["serve", "--max-batch", "16", "--batch-invariant"]))
    assert invariant.engine_settings("cuda:0")["isolate_requests"] is True  # every request computed alone
    assert (cfg.api_key, cfg.max_batch, cfg.max_wait_ms, cfg.max_queue, cfg.port) == ("k", 2, 1.5, 9, 8123)
    assert cfg.sampler_defaults() == {"steps": 2, "guidance": 1.5, "shift": 4.0, "guidance_interval": (960, 1001)}


def test_kernel_flags_fail_at_startup_where_they_cannot_run() -> None:
    from wamrt.engine.epilogues import quack_available
    from wamrt.ops.attention import fa4_available
    from wamrt.serving.config import ServeConfigError

    args = build_parser().parse_args(["serve", "--attention", "flash", "--epilogues", "inductor"])
    assert config_from_args(args).engine_settings("cuda:0")["attention"] == "flash"
    for flags, flag in ((["--attention", "fa4"], "--attention"), (["--epilogues", "quack"], "--epilogues")):
        cfg = config_from_args(build_parser().parse_args(["serve", *flags]))
        with pytest.raises(ServeConfigError, match="CUDA GPU only") as err:
            cfg.engine_settings("cpu")
        assert err.value.flag == flag
        if not (fa4_available() if flag == "--attention" else quack_available()):
            with pytest.raises(ServeConfigError, match="installed") as err:
                cfg.engine_settings("cuda:0")
            assert err.value.flag == flag
    with pytest.raises(ServeConfigError) as err:
        ServeConfig(epilogues="cutlass")
    assert err.value.flag == "--epilogues"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention", "math"])


def test_kernel_flags_refused_by_an_eager_server(capsys) -> None:
    from wamrt.serving.server import run

    assert run(build_parser().parse_args(["serve", "--epilogues", "quack", "--engine", "eager"])) == 2
    assert "--epilogues: applies to the fast engine" in capsys.readouterr().err
    assert run(build_parser().parse_args(["serve", "--attention", "fa4", "--engine", "fast"])) == 2  # CPU here
    assert "--attention: fa4 runs on a CUDA GPU only" in capsys.readouterr().err


def test_readyz_waits_for_warm_up(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=1.0)  # the warm-up request takes a second
    server = ServerThread(policy, ServeConfig(warmup_requests=1), wait_ready=False).start()
    try:
        url = server.http_url
        assert httpx.get(url + "/healthz").text == "OK\n"  # live at once
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        deadline = time.monotonic() + 10
        while httpx.get(url + "/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = httpx.get(url + "/readyz").json()
        assert ready == {"ready": True, "warmup": {"seconds": ready["warmup"]["seconds"]}}  # no queue, no errors
        assert ready["warmup"]["seconds"] >= 1.0  # the warm-up request's second, reported (no graphs to capture)
        assert policy.calls[:1] == [1]  # the warm-up went through the real engine path
    finally:
        server.stop()


def test_http_reset_then_infer(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    url = fake_server.http_url + "/v1/policy/infer"
    r = httpx.post(url, content=packb({"endpoint": "reset", "session_id": "s"}), headers=MSGPACK)
    assert r.status_code == 200 and unpackb(r.content)["status"] == "reset successful"
    assert httpx.post(url, json={"endpoint": "reset"}).json()["status"] == "reset successful"
    r = httpx.post(url, content=packb({**obs, "reset": np.zeros(2)}), headers=MSGPACK)  # not truth-tested
    assert r.status_code == 400 and unpackb(r.content)["field"] == "reset"
    assert unpackb(httpx.post(url, content=packb(obs), headers=MSGPACK).content)["actions"].shape == (32, 8)


def test_roboarena_error_keeps_the_socket(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    no_prompt = {k: v for k, v in obs.items() if k != "prompt"}
    with connect(fake_server.ws_url, max_size=None) as ws:
        ws.recv()
        ws.send(openpi_msgpack.packb({**no_prompt, "endpoint": "infer"}))
        err = json.loads(ws.recv())  # RoboArena/openpi: a text frame
        assert err["code"] == "invalid_request" and err["field"] == "prompt"
        ws.send(openpi_msgpack.packb({**obs, "endpoint": "infer"}))
        assert openpi_msgpack.unpackb(ws.recv()).shape == (32, 8)


def test_wrong_api_key_then_right_one(obs: dict[str, Any]) -> None:
    with ServerThread(FakePolicy(), ServeConfig(api_key="k1")) as server:
        for headers in ({"Authorization": "Bearer nope"}, {"Api-Key": "nope"}):
            with pytest.raises(websockets.InvalidStatus) as info:
                connect(server.ws_url + "/v1/realtime/robot/openpi", additional_headers=headers)
            assert info.value.response.status_code == 401
        r = httpx.post(server.http_url + "/v1/videos", data={"prompt": "x"}, headers={"api-key": "nope"})
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
        for headers in ({"Authorization": "Bearer k1"}, {"Api-Key": "k1"}):
            with connect(server.ws_url + "/v1/realtime/robot/openpi", additional_headers=headers) as ws:
                ws.recv()
                ws.send(packb(obs))
                assert unpackb(ws.recv()).shape == (32, 8)
        assert WebsocketClientPolicy(server.ws_url, api_key="k1").infer(obs)["actions"].shape == (32, 8)


def test_bad_video_requests_then_a_good_one(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    url = fake_server.http_url
    for form in ({"prompt": "x", "extra_params": "{"}, {"prompt": "x", "seed": "abc"},
                 {"prompt": "x", "num_inference_steps": "0"}, {"prompt": "x", "extra_params": '{"robot_obs": 5}'}):
        r = httpx.post(url + "/v1/videos/sync", data=form)
        assert r.status_code == 400 and r.json()["code"] == "invalid_request", (form, r.text)
    small = {k: (v[::8, ::8] if k.endswith("_left") else v) for k, v in obs.items()}  # any view size works
    robot = {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in small.items()}
    r = httpx.post(url + "/v1/videos/sync", json={"prompt": obs["prompt"], "extra_params": {"robot_obs": robot}})
    assert r.status_code == 200 and r.json()["data"][0]["action"]["shape"] == [32, 8]


# --- property-based decoder tests -----------------------------------------------------------------

_KEYS = st.sampled_from(["prompt", "observation/image", "observation/wrist_image_left",
                         "observation/exterior_image_1_left", "observation/joint_position",
                         "observation/gripper_position", "session_id", "seed", "reset", "params", "endpoint",
                         "timestamp", "max_age_ms", "embodiment", "env_id", "surprise"])
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                  st.text(max_size=8), st.binary(max_size=8),
                  st.builds(lambda s, d: np.zeros(s, d), st.lists(st.integers(0, 5), max_size=4).map(tuple),
                            st.sampled_from([np.uint8, np.float32, np.float64, np.int64, bool])))
_VALUE = st.recursive(_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=6)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUE, max_size=8))
def test_observation_decoder_only_raises_typed_errors(msg: dict[str, Any]) -> None:
    """Any map: parsed, or refused with a typed error naming a field; never another exception."""
    try:
        req = parse_request(msg)
    except ServingError as exc:
        assert exc.status in (400, 422) and exc.code in ("invalid_request", "stale")
        return
    except (RequestError, WireError):
        return
    assert req.endpoint in ("infer", "reset")


_EXTRA = st.fixed_dictionaries({"action_mode": st.sampled_from(["forward_dynamics", "inverse_dynamics"])}, optional={
    "action": _VALUE, "video": _VALUE, "action_chunk_size": _VALUE, "domain_name": _VALUE, "domain_id": _VALUE,
    "raw_action_dim": _VALUE, "image_size": _VALUE, "view_point": _VALUE, "num_steps": _VALUE,
    "guidance": _VALUE, "guidance_interval": _VALUE})
_FIELDS = st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=8)}, optional={
    "seed": st.text(max_size=4), "num_frames": st.text(max_size=4), "fps": st.text(max_size=4),
    "num_inference_steps": st.text(max_size=4), "input_reference": st.binary(max_size=64),
    "image_reference": st.text(max_size=12), "video_reference": st.text(max_size=12)})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_FIELDS, _EXTRA)
def test_dynamics_form_decoder_only_raises_invalid_request(fields: dict[str, Any], extra: dict[str, Any]) -> None:
    """Garbage FD/ID fields are refused as invalid_request with a field (nothing reaches the engine)."""
    try:
        req = build_dynamics(fields, extra, extra["action_mode"], {})
    except ServingError as exc:
        assert exc.code == "invalid_request" and exc.field, exc
        return
    assert req.kwargs["chunk_size"] % 4 == 0
