"""vLLM-Omni `/v1/videos` jobs, the safety envelope, overload, and `wamrt bench load` (fake engine)."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from oracle.fake_policy import FakePolicy
from PIL import Image

from wamrt.bench.load import check_url, run_load
from wamrt.client import PolicyClient, ServerError
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.errors import SafetyRejected
from wamrt.serving.safety import SafetyEnvelope

FRANKA_LO = [-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973]
FRANKA_HI = [2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973]


def _robot_obs(obs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in obs.items()}


def _poll(url: str, vid: str) -> dict[str, Any]:
    for _ in range(200):
        rec = httpx.get(f"{url}/v1/videos/{vid}").json()
        if rec["status"] in ("completed", "failed"):
            return rec
        time.sleep(0.02)
    raise AssertionError("job never finished")


def test_video_job_lifecycle(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    url = fake_server.http_url
    small = {**obs, "observation/wrist_image_left": obs["observation/wrist_image_left"][::4, ::4],
             "observation/exterior_image_1_left": obs["observation/exterior_image_1_left"][::4, ::4],
             "observation/exterior_image_2_left": obs["observation/exterior_image_2_left"][::4, ::4]}
    form = {"prompt": obs["prompt"], "seed": "7", "num_inference_steps": "2",
            "extra_params": json.dumps({"action_mode": "policy", "domain_name": "droid_lerobot",
                                        "robot_obs": _robot_obs(small)})}
    rec = httpx.post(url + "/v1/videos", data=form).json()
    assert rec["object"] == "video" and rec["id"].startswith("video_gen_") and rec["status"] == "queued"
    done = _poll(url, rec["id"])
    assert done["status"] == "completed" and done["progress"] == 100
    assert done["action"]["shape"] == [32, 8] and done["action"]["domain_id"] == 8
    assert np.asarray(done["action"]["data"]).shape == (32, 8)
    assert done["inference_time_s"] > 0 and done["peak_memory_mb"] > 0 and "denoise" in done["stage_durations"]
    assert any(r["id"] == rec["id"] for r in httpx.get(url + "/v1/videos").json()["data"])
    assert httpx.get(f"{url}/v1/videos/{rec['id']}/content").status_code == 200
    assert httpx.delete(f"{url}/v1/videos/{rec['id']}").json()["deleted"] is True
    assert httpx.get(f"{url}/v1/videos/{rec['id']}").status_code == 404
    assert httpx.get(url + "/v1/models").json()["data"][0]["object"] == "model"


def test_video_sync_with_input_reference(fake_server: ServerThread, obs: dict[str, Any]) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((540, 640, 3), np.uint8)).save(buf, format="PNG")
    state = [*obs["observation/joint_position"].tolist(), 0.1]
    r = httpx.post(fake_server.http_url + "/v1/videos/sync",
                   data={"prompt": "pick", "extra_params": json.dumps({"action": state})},
                   files={"input_reference": ("c.png", buf.getvalue(), "image/png")})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"].startswith("video_sync-") and float(r.headers["x-inference-time-s"]) > 0
    assert json.loads(r.headers["x-stage-durations"])
    body = r.json()
    assert body["id"] == r.headers["x-request-id"]  # the id the server logged
    assert body["data"][0]["action"]["shape"] == [32, 8] and body["data"][0]["b64_json"] is None


@pytest.mark.parametrize("extra", [{"action_mode": "forward_dynamics"}, {"domain_name": "bridge_orig_lerobot"},
                                   {"robot_obs": {"prompt": "x"}}, "not json"])
def test_video_bad_requests(fake_server: ServerThread, extra: Any, obs: dict[str, Any]) -> None:
    ep = extra if isinstance(extra, str) else json.dumps(extra)
    r = httpx.post(fake_server.http_url + "/v1/videos", data={"prompt": "x", "extra_params": ep})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request"
    assert httpx.post(fake_server.http_url + "/v1/videos", data={"extra_params": "{}"}).status_code == 400


def _envelope_file(tmp_path: Path, mode: str) -> Path:
    path = tmp_path / f"safety_{mode}.json"
    path.write_text(json.dumps({"default": "droid", "embodiments": {"droid": {
        "mode": mode, "joint_lower": FRANKA_LO, "joint_upper": FRANKA_HI, "max_step_delta": 0.1,
        "gripper": [0.0, 1.0]}}}))
    return path


def test_safety_envelope_unit(tmp_path: Path) -> None:
    env = SafetyEnvelope.load(_envelope_file(tmp_path, "clamp"))
    state = np.zeros(7)
    state[3], state[5] = -1.0, 1.0
    ok = np.tile(np.r_[state, 0.5], (32, 1)).astype(np.float32)
    same, report = env.apply(ok, state)
    assert report.violations == 0 and same is ok
    wild = ok.copy()
    wild[5, 0] = 9.0  # over the joint limit and a huge step
    wild[:, 7] = 1.5
    clamped, report = env.apply(wild, state)
    assert report.clamped and report.violations >= 3
    assert (clamped[:, :7] <= np.array(FRANKA_HI) + 1e-6).all()
    assert np.abs(np.diff(np.vstack([state, clamped[:, :7]]), axis=0)).max() <= 0.1 + 1e-6
    assert clamped[:, 7].max() == 1.0
    with pytest.raises(SafetyRejected):
        SafetyEnvelope.load(_envelope_file(tmp_path, "reject")).apply(wild, state)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"embodiments": {"x": {"mode": "explode"}}}))
    with pytest.raises(ValueError):
        SafetyEnvelope.load(bad)


def test_safety_in_server(tmp_path: Path, obs: dict[str, Any]) -> None:
    wild = np.zeros((32, 8), np.float32)
    wild[:, 0] = 2.5  # far from the observed joint 0 in one step; joint 3 = 0 is above its upper limit
    for mode in ("clamp", "reject"):
        cfg = ServeConfig(safety_file=str(_envelope_file(tmp_path, mode)))
        with ServerThread(FakePolicy(actions=wild), cfg) as server, PolicyClient(server.ws_url) as c:
            if mode == "clamp":
                out = c.infer(obs)
                assert out["metadata"]["safety"]["clamped"] is True
                assert np.abs(out["actions"][0, 0] - obs["observation/joint_position"][0]) <= 0.1 + 1e-5
            else:
                with pytest.raises(ServerError) as info:
                    c.infer(obs)
                assert info.value.code == "safety_rejected"
            assert "wamrt_safety_interventions_total" in httpx.get(server.http_url + "/metrics").text


def test_overload_busy_no_crash_all_accepted_answered(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.15)
    cfg = ServeConfig(max_batch=2, max_wait_ms=5, max_queue=2)
    lanes, results = 10, []
    lock = threading.Lock()
    with ServerThread(policy, cfg) as server:
        def lane() -> None:
            with PolicyClient(server.ws_url) as c:
                for _ in range(3):
                    try:
                        out = c.infer(obs, timeout=30)
                        item = ("ok", out["actions"].shape)
                    except ServerError as exc:
                        item = (exc.code, None)
                    with lock:
                        results.append(item)

        threads = [threading.Thread(target=lane) for _ in range(lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == lanes * 3  # every request got an answer
        codes = {code for code, _ in results}
        assert codes <= {"ok", "busy"} and "busy" in codes and "ok" in codes
        assert all(shape == (32, 8) for code, shape in results if code == "ok")
        assert max(policy.calls) <= 2
        metrics = httpx.get(server.http_url + "/metrics").text  # queue depth: on /metrics, not the open /readyz
        assert "wamrt_queue_depth 0.0" in metrics and 'wamrt_errors_total{code="busy"}' in metrics


def test_bench_load_reports(obs: dict[str, Any]) -> None:
    with ServerThread(FakePolicy(delay=0.05), ServeConfig(max_batch=4, max_wait_ms=20)) as server:
        summary = run_load(server.ws_url, lanes=3, seconds=1.0, warmup=1)
    assert summary["kind"] == "load" and summary["requests"] > 3 and summary["errors"] == {}
    assert summary["p50_ms"] <= summary["p99_ms"] and summary["throughput_rps"] > 0
    assert sum(summary["batch_hist"].values()) == summary["requests"]


@pytest.mark.parametrize("url", ["ws://10.0.0.1:8000", "ws://example.com", "http://127.0.0.1:8000"])
def test_bench_load_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ValueError):
        check_url(url)
    assert check_url("ws://127.0.0.1:1/v1/realtime/robot/openpi")


@pytest.mark.parametrize(("field", "value"), [("num_inference_steps", 3.7), ("num_inference_steps", True),
                                              ("guidance_scale", "nan"), ("seed", 1.5), ("seed", -1)])
def test_video_policy_fields_are_not_coerced(field: str, value: Any, obs: dict[str, Any]) -> None:
    """JSON numbers reach the policy path unconverted: a fractional step count is refused, not truncated."""
    from wamrt.serving.errors import InvalidRequest
    from wamrt.serving.videos import build_request

    fields = {"prompt": obs["prompt"], field: value,
              "extra_params": {"action_mode": "policy", "robot_obs": _robot_obs(obs)}}
    with pytest.raises(InvalidRequest) as err:
        build_request(fields)
    assert err.value.field == field
