"""Issue 39: one bad request must not stall every robot. Every finding of the adversarial pass, as the attacker
sent it, against `wamrt serve --model tiny-world` with default limits in a process of its own (so the server's
own RSS is measured).

Each case asserts the typed status and field and the server's peak RSS growth (`/proc/PID/clear_refs` + VmHWM)
within RSS_BOUND; and `/healthz` answering within HEALTH_MS while the bad request is in flight (polled from another
process) and, where the finding was a stall, a concurrent policy request within 2 x its solo latency, in the best
of ATTEMPTS attempts (oracle/abuse.py says why). The sizes are smaller than the
issue's where the mechanism does not depend on size (8 MB of empty msgpack maps fails on the value count, as
60 MB would), and equal where it does (the body cap, the 8192 x 8192 picture, the 257-frame 1080p video). The
connection side (findings 6-8, 11) is test_abuse_connections.py; the shared measurement is oracle/abuse.py.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import numpy as np
import pytest
from oracle.abuse import (
    MB,
    MSGPACK,
    OBS,
    VLLM,
    checked,
    chunked_post,
    empty_maps_msgpack,
    errors_total,
    nested_list_json,
    png,
    png_header_only,
    temp_files,
    typed,
)
from websockets.sync.client import connect

from wamrt.bench.server_process import ServerProcess
from wamrt.client.wire import packb, unpackb
from wamrt.pipeline.controls import HINT_KEYS

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def world() -> Iterator[ServerProcess]:
    """tiny-world (policy, dynamics, world generation, a real tokenizer) with default limits."""
    with ServerProcess.serve(["--model", "tiny-world", "--device", "cpu", "--steps", "1"]) as server:
        yield server


@pytest.fixture(scope="module")
def long_video() -> bytes:
    """The issue's 23 KB MP4: 257 black frames of 1920 x 1088."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 1920, 1088, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51"}
        frame = av.VideoFrame.from_ndarray(np.zeros((1088, 1920, 3), np.uint8), format="rgb24").reformat(
            format="yuv420p")
        for _ in range(257):
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()




# --- 1. parsing and decoding off the event loop, bounded by structure and pixels ---------------------------

def test_msgpack_of_empty_maps_is_refused_by_its_value_count(world: ServerProcess) -> None:
    """8 MB over HTTP (8 M maps; over the value bound after 65 536); 4 MB over the websocket, whose library
    unmasks a frame on the event loop in one go (~2.5 ms per MB: docs/serving.md), not what this case measures."""
    blob, frame = empty_maps_msgpack(8 * MB), empty_maps_msgpack(4 * MB)

    with connect(world.ws_url + VLLM, max_size=None, open_timeout=30) as ws:
        ws.recv()  # handshake

        def attack() -> list[dict[str, Any]]:
            r = httpx.post(world.url + "/v1/policy/infer", content=blob, headers=MSGPACK, timeout=60)
            ws.send(frame)
            return [typed(r, 400, code="invalid_request"), unpackb(ws.recv(timeout=60))]

        def verify(errors: list[dict[str, Any]]) -> None:
            assert "values" in errors[0]["message"] and errors[1]["code"] == "invalid_request"

        checked(world, attack, verify, probe=True, min_polls=1)
        ws.send(packb(OBS))  # the socket lives on
        assert unpackb(ws.recv(timeout=60)).shape == (32, 8)


def test_json_image_as_nested_lists_is_refused_before_parsing(world: ServerProcess) -> None:
    body = nested_list_json(8 * MB)  # 3 M values: over the 2 M bound (the issue sent 32 MB)
    checked(world, lambda: httpx.post(
        world.url + "/v1/policy/infer", content=body, headers={"content-type": "application/json"}, timeout=60),
        lambda r: "value limit" in typed(r, 400, code="invalid_request")["message"], probe=True, min_polls=1)


def test_a_huge_picture_is_refused_from_its_header(world: ServerProcess) -> None:
    """8192 x 8192 PNG (~65 KB) as a policy view (JSON b64) and as a policy job's input_reference, eight at once."""
    big = png(8192, 8192)
    obs = {"prompt": "pick up the cup", "observation/image": {"b64": base64.b64encode(big).decode()},
           "observation/joint_position": [0.0] * 7, "observation/gripper_position": 0.0}
    form = {"prompt": "pick up the cup", "extra_params": json.dumps({"action_mode": "policy", "action": [0.0] * 8})}

    client = httpx.Client(base_url=world.url, timeout=60, limits=httpx.Limits(max_connections=8))
    obs_body = json.dumps(obs).encode()

    def attack() -> list[httpx.Response]:
        def one(i: int) -> httpx.Response:
            if i % 2:
                return client.post("/v1/policy/infer", content=obs_body, headers={"content-type": "application/json"})
            return client.post("/v1/videos/sync", data=form, files={"input_reference": ("a.png", big)})
        out: list[httpx.Response] = [None] * 8  # type: ignore[list-item]
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    def verify(replies: list[httpx.Response]) -> None:
        assert {typed(r, 400, code="invalid_request")["field"] for r in replies} == {"observation/image",
                                                                                     "input_reference"}

    checked(world, attack, verify, probe=True)
    client.close()


# --- 2. prompts bounded by tokens, on every surface ------------------------------------------------------

@pytest.mark.parametrize("chars", [150_000, 1_000_000])
def test_a_long_generation_prompt_is_refused_uncounted(world: ServerProcess, chars: int) -> None:
    form = {"prompt": "a" * chars, "size": "32x32", "num_frames": "1", "num_inference_steps": "1"}
    checked(world, lambda: httpx.post(world.url + "/v1/videos/sync", data=form, timeout=60),
            lambda r: "--max-generation-prompt-tokens" in typed(r, 400, "prompt")["message"], probe=True)
    neg = httpx.post(world.url + "/v1/images/generations", json={**form, "prompt": "p", "negative_prompt": "a" * chars},
                     timeout=60)
    typed(neg, 400, "negative_prompt")


def test_policy_prompts_count_tokens_not_characters(world: ServerProcess) -> None:
    """4 096 emoji pass a character cap but are ~16 000 tokens; a 300-token instruction still runs."""
    with connect(world.ws_url, max_size=None, open_timeout=30) as ws:
        ws.recv()
        ws.send(packb({**OBS, "prompt": "\U0001F600" * 4096}))
        err = json.loads(ws.recv(timeout=60))
        assert err["code"] == "invalid_request" and err["field"] == "prompt" and "tokens" in err["message"]
        ws.send(packb({**OBS, "prompt": "grasp the red cube " * 14}))  # ~300 tokens (tiny-world's are characters)
        out = unpackb(ws.recv(timeout=60))
        assert out["actions"].shape == (32, 8) and 250 < out["metadata"]["prompt_tokens"] <= 1024


# --- 3. bodies bounded as they stream --------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/videos", "/v1/videos/sync", "/v1/images/generations", "/v1/policy/infer"])
def test_chunked_bodies_stop_at_the_cap(world: ServerProcess, path: str) -> None:
    head = b'{"prompt": "a robot arm", "negative_prompt": "'
    def verify(reply: tuple[int, bytes, int]) -> None:
        status, body, sent = reply
        assert status == 413 and json.loads(body)["code"] == "payload_too_large"
        assert sent < 80 * MB  # cut once it passed the 64 MB cap, not read to the end

    checked(world, lambda: chunked_post(world.url, path, "application/json", 100 * MB, head=head), verify,
            min_polls=1)


def test_chunked_multipart_writes_no_temp_file(world: ServerProcess) -> None:
    boundary = "xyzzy"
    head = (f"--{boundary}\r\ncontent-disposition: form-data; name=\"prompt\"\r\n\r\na robot arm\r\n--{boundary}\r\n"
            "content-disposition: form-data; name=\"input_reference\"; filename=\"v.mp4\"\r\n"
            "content-type: video/mp4\r\n\r\n").encode()
    checked(world, lambda: chunked_post(world.url, "/v1/videos", f"multipart/form-data; boundary={boundary}",
                                        100 * MB, head=head),
            lambda reply: reply[0] == 413 and json.loads(reply[1])["code"] == "payload_too_large", min_polls=1)
    # A good multipart upload, and one whose client hangs up mid-body: no temporary file stays open.
    r = httpx.post(world.url + "/v1/videos", data={"prompt": "p", "size": "32x32", "num_frames": "1",
                                                   "num_inference_steps": "1"},
                   files={"input_reference": ("a.png", png(32, 32))}, timeout=60)
    assert r.status_code == 400 and r.json()["field"] == "input_reference"  # a single frame + an image: refused
    with socket.create_connection(("127.0.0.1", world.port)) as s:
        s.sendall(f"POST /v1/videos HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; boundary={boundary}"
                  f"\r\ncontent-length: {10 * MB}\r\n\r\n".encode() + head + b"0" * MB)
    time.sleep(0.3)
    assert temp_files(world) == []


# --- 4. a generation step bounded by the served model's cost ---------------------------------------------

@pytest.mark.parametrize("size", ["2048x2048", "8192x8192"])
def test_a_generation_step_over_the_time_bound_is_refused(world: ServerProcess, size: str) -> None:
    form = {"prompt": "a robot arm", "size": size, "num_frames": "1", "num_inference_steps": "2"}
    client = httpx.Client(base_url=world.url, timeout=60)
    checked(world, lambda: client.post("/v1/images/generations", data=form),
            lambda r: "--max-step-ms" in typed(r, 400, "size")["message"], probe=True)
    client.close()


def test_the_cost_model_names_the_field_that_makes_a_job_too_large() -> None:
    from dataclasses import replace

    from wamrt.serving.errors import InvalidRequest
    from wamrt.serving.limits import GenerationCost

    cost = GenerationCost(layers=2, hidden=64, attn_width=64, kv_width=32, mlp_width=128, gated=True, patch=2,
                          flops_per_s=GenerationCost.CPU_FLOPS, max_step_ms=250.0, max_job_s=900.0)  # tiny-world
    step = cost.step_ms(1, 512, 512, text_tokens=60, branches=2)
    assert 0 < step < cost.max_step_ms  # 256 tokens a branch: allowed
    assert cost.step_ms(1, 8192, 8192, text_tokens=60, branches=2) > 1e3 * step  # attention: quadratic
    assert cost.check(num_frames=1, height=512, width=512, steps=35, count=1, text_tokens=60, branches=2,
                      size_field="size") == step
    cases = [(cost, dict(num_frames=1, height=2048, width=2048, steps=1, count=1), "size"),
             (cost, dict(num_frames=33, height=256, width=256, steps=1, count=1), "num_frames"),  # one frame fits
             (replace(cost, max_job_s=300.0), dict(num_frames=1, height=512, width=512, steps=1000, count=10), "n"),
             (replace(cost, max_job_s=60.0), dict(num_frames=1, height=512, width=512, steps=1000, count=1),
              "num_inference_steps")]
    for model, job, name in cases:
        with pytest.raises(InvalidRequest) as err:
            model.check(**job, text_tokens=60, branches=2, size_field="size")
        assert err.value.field == name, (job, err.value.message)


# --- 5. uploaded videos decoded only as far as used ------------------------------------------------------

def test_a_long_video_upload_decodes_only_the_frames_used(world: ServerProcess, long_video: bytes) -> None:
    """V2V conditions on 5 frames: 5 of the 257 1080p frames are decoded (1 GB+ if all were). Inverse dynamics
    needs every frame: 257 x 1080p is over the per-upload decode budget, refused before decoding."""
    form = {"prompt": "a robot arm", "size": "32x32", "num_frames": "9", "num_inference_steps": "1"}
    client = httpx.Client(base_url=world.url, timeout=120)

    def attack() -> list[httpx.Response]:
        two = [None, None]
        threads = [threading.Thread(target=lambda i=i: two.__setitem__(i, client.post(
            "/v1/videos/sync", data=form, files={"input_reference": ("v.mp4", long_video)}))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return two  # type: ignore[return-value]

    def verify(replies: list[httpx.Response]) -> None:
        for r in replies:
            assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text[:300]

    checked(world, attack, verify)
    idm = {"prompt": "p", "extra_params": json.dumps({"action_mode": "inverse_dynamics", "image_size": 256})}
    checked(world, lambda: client.post("/v1/videos", data=idm, files={"input_reference": ("v.mp4", long_video)}),
            lambda r: "budget" in typed(r, 400, "input_reference")["message"])
    client.close()


def test_decode_video_stops_at_the_frames_used() -> None:
    from dataclasses import replace

    from wamrt.serving.dynamics import decode_video
    from wamrt.serving.errors import InvalidRequest
    from wamrt.serving.limits import DEFAULT_LIMITS
    from wamrt.serving.media import encode_mp4

    ramp = (np.arange(12, dtype=np.uint8) * 20)[:, None, None, None]
    mp4 = encode_mp4(np.broadcast_to(ramp, (12, 32, 32, 3)).copy(), 12.0)
    first = decode_video(mp4, "v", max_frames=5)
    last = decode_video(mp4, "v", max_frames=5, keep="last")
    assert first.shape == last.shape == (5, 32, 32, 3)
    assert abs(float(first[-1].mean()) - 80) < 4 and abs(float(last[0].mean()) - 140) < 4  # frames 4 and 7
    with pytest.raises(InvalidRequest, match="budget") as err:  # 12 frames, a budget of 8
        decode_video(mp4, "v", keep="last", limits=replace(DEFAULT_LIMITS, decoded_pixels=8 * 32 * 32))
    assert err.value.field == "v"
    assert len(decode_video(mp4, "v", limits=replace(DEFAULT_LIMITS, decoded_pixels=8 * 32 * 32), max_frames=8)) == 8


# --- 6. one client cannot monopolize the policy engine -------------------------------------------------------

def test_policy_steps_are_bounded(world: ServerProcess) -> None:
    client = httpx.Client(base_url=world.url, timeout=60)
    checked(world, lambda: client.post("/v1/policy/infer", content=packb({**OBS, "params": {"num_steps": 40}}),
                                       headers=MSGPACK),
            lambda r: "--max-policy-steps" in typed(r, 400, "params.steps")["message"], probe=True)
    fd = {"prompt": "p", "num_inference_steps": "40",
          "extra_params": json.dumps({"action_mode": "forward_dynamics", "action": [[0.0] * 10] * 4})}
    r = client.post("/v1/videos/sync", data=fd, files={"input_reference": ("a.png", png(32, 32))})
    typed(r, 400, "num_inference_steps")
    client.close()


# --- 9. typed 4xx where a 500 was ------------------------------------------------------------------------

_DEEP = "[" * 100_000 + "]" * 100_000
_BOMB = png_header_only(50_000, 50_000)
_GEN = {"prompt": "a robot arm", "size": "32x32", "num_frames": "1", "num_inference_steps": "1"}
_POLICY_JOB = {"prompt": "pick up the cup", "extra_params": json.dumps({"action_mode": "policy", "action": [0.0] * 8})}


def test_deep_json_is_a_400_on_every_json_surface(world: ServerProcess) -> None:
    deep_obs = '{"prompt": "p", "observation/image": ' + _DEEP + "}"
    with httpx.Client(base_url=world.url, timeout=60) as c:
        for path in ("/v1/policy/infer", "/v1/videos", "/v1/videos/sync", "/v1/images/generations"):
            r = c.post(path, content=deep_obs, headers={"content-type": "application/json"})
            assert "nested" in typed(r, 400, code="invalid_request")["message"], path
        r = c.post("/v1/videos", data={"prompt": "p", "extra_params": _DEEP})
        typed(r, 400, "extra_params")
        r = c.post("/v1/videos", data={"prompt": "p", "image_reference": _DEEP, "extra_params": json.dumps(
            {"action_mode": "forward_dynamics", "action": [[0.0] * 10] * 4})})
        typed(r, 400, "image_reference")


def test_a_picture_header_claiming_50000_squared_is_a_400(world: ServerProcess) -> None:
    obs = {"prompt": "p", "observation/image": {"b64": base64.b64encode(_BOMB).decode()},
           "observation/joint_position": [0.0] * 7, "observation/gripper_position": 0.0}
    fd = {"prompt": "p", "extra_params": json.dumps({"action_mode": "forward_dynamics", "action": [[0.0] * 10] * 4})}
    with httpx.Client(base_url=world.url, timeout=60) as c:
        typed(c.post("/v1/policy/infer", json=obs), 400, "observation/image")
        for form in (_POLICY_JOB, fd, {**_GEN, "num_frames": "5"}):
            typed(c.post("/v1/videos", data=form, files={"input_reference": ("b.png", _BOMB)}), 400, "input_reference")
        r = c.post("/v1/videos", data=_POLICY_JOB, files={"input_reference": ("b.png", b"not an image")})
        typed(r, 400, "input_reference")  # (Pillow's own message names a BytesIO at 0x7f...: not sent)


@pytest.mark.parametrize(("form", "field"), [
    ({**_GEN, "guidance_scale": "1e308"}, "guidance_scale"),
    ({**_GEN, "flow_shift": "1e-300"}, "flow_shift"),
    ({**_GEN, "flow_shift": "1e308"}, "flow_shift"),
    ({**_GEN, "num_frames": "", "seconds": "1e308"}, "seconds"),
    ({**_GEN, "fps": "1e-300"}, "fps"),
    ({**_GEN, "fps": "nan"}, "fps"),
    ({**_GEN, "num_frames": "1_3"}, "num_frames"),
    ({**_GEN, "num_inference_steps": "1_0"}, "num_inference_steps"),
    ({**_GEN, "guidance_scale": "6_0"}, "guidance_scale"),
    ({**_POLICY_JOB, "guidance_scale": "1e308"}, "params.guidance"),
    ({**_POLICY_JOB, "extra_params": json.dumps({"action_mode": "policy", "action": "abc"})}, "extra_params.action"),
    ({**_POLICY_JOB, "extra_params": json.dumps({"action_mode": "policy", "action": [[1, 2], [3]]})},
     "extra_params.action"),
    ({**_POLICY_JOB, "extra_params": json.dumps({"action_mode": "policy", "action": ["a"] * 8})},
     "extra_params.action"),
    ({**_POLICY_JOB, "extra_params": json.dumps({"action_mode": "policy", "action": [0.0] * 8,
                                                  "guidance_interval": [1, 1e400]})}, "params.guidance_interval"),
])
def test_out_of_range_fields_are_400s(world: ServerProcess, form: dict[str, str], field: str) -> None:
    with httpx.Client(base_url=world.url, timeout=60) as c:
        for path in ("/v1/videos", "/v1/videos/sync"):
            typed(c.post(path, data=form, files={"input_reference": ("a.png", png(32, 32))} if "action_mode" in
                         form.get("extra_params", "") else None), 400, field)


def test_policy_params_out_of_range_are_400s(world: ServerProcess) -> None:
    with httpx.Client(base_url=world.url, timeout=60) as c:
        for params, field in (({"guidance": 1e308}, "params.guidance"), ({"shift": 1e-300}, "params.shift"),
                              ({"shift": 1e308}, "params.shift"), ({"guidance_interval": [float("nan"), 1]},
                                                                   "params.guidance_interval")):
            r = c.post("/v1/policy/infer", content=packb({**OBS, "params": params}), headers=MSGPACK)
            typed(r, 400, field)
        body = json.dumps({"prompt": "p", "params": {"guidance_interval": [float("nan"), 1]}})  # JSON's NaN literal
        typed(c.post("/v1/policy/infer", content=body, headers={"content-type": "application/json"}), 400)


def test_malformed_forms_are_400s(world: ServerProcess) -> None:
    with httpx.Client(base_url=world.url, timeout=60) as c:
        r = c.post("/v1/videos", content=b"--x\r\n", headers={"content-type": "multipart/form-data"})
        typed(r, 400, "content-type")
        files = {f"f{i}": (f"{i}.png", png(8, 8)) for i in range(2 + len(HINT_KEYS))}  # a reference + every hint, + 1
        assert "files" in typed(c.post("/v1/videos", data={"prompt": "p"}, files=files), 400)["message"]
        fields = {f"k{i}": "v" for i in range(65)}
        assert "fields" in typed(c.post("/v1/videos", data=fields), 400)["message"]
        typed(c.post("/v1/videos", content=b"x", headers={"content-type": "text/plain"}), 415)
        internal = errors_total(world, "internal_error")
        for _ in range(5):  # clients that hang up mid-upload: not server errors
            with socket.create_connection(("127.0.0.1", world.port)) as s:
                s.sendall(b"POST /v1/videos HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 100000\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)
        assert errors_total(world, "internal_error") == internal
        assert errors_total(world, "cancelled") >= 5


# --- 10. wrong results fixed ------------------------------------------------------------------------------

def test_fps_in_range_is_what_the_mp4_says(world: ServerProcess) -> None:
    r = httpx.post(world.url + "/v1/videos/sync", data={**_GEN, "num_frames": "5", "fps": "7.5"}, timeout=120)
    assert r.status_code == 200, r.text
    with av.open(io.BytesIO(r.content)) as f:
        assert float(f.streams.video[0].average_rate) == 7.5


def test_empty_references_and_future_timestamps_are_400s(world: ServerProcess) -> None:
    with httpx.Client(base_url=world.url, timeout=60) as c:
        for form in (_GEN, _POLICY_JOB):
            typed(c.post("/v1/videos", data=form, files={"input_reference": ("empty.png", b"")}), 400,
                  "input_reference")
        r = c.post("/v1/policy/infer", content=packb({**OBS, "timestamp": time.time() + 3600, "max_age_ms": 200}),
                   headers=MSGPACK)
        typed(r, 400, "timestamp")
        r = c.post("/v1/policy/infer", content=packb({**OBS, "timestamp": time.time() + 0.2, "max_age_ms": 5000}),
                   headers=MSGPACK)
        assert r.status_code == 200, r.text  # a little clock skew is not an error


# --- 7 (continued). SIGTERM with world generation running: the `world` server's last test -----------------

def test_zz_sigterm_cancels_generation_by_the_deadline(world: ServerProcess) -> None:
    """Runs last in this module: it ends the shared `world` server. A running generation job is given half the
    grace, then stops at its next step; queued ones end at once; each answers a typed 503; the process exits
    within the default 10 s grace."""
    long_job = {"prompt": "a robot arm", "size": "64x64", "num_frames": "9", "num_inference_steps": "400"}
    replies: dict[str, httpx.Response] = {}
    client = httpx.Client(base_url=world.url, timeout=60, limits=httpx.Limits(max_connections=8))

    def post(name: str, path: str, data: dict[str, str]) -> None:
        replies[name] = client.post(path, data=data)

    jobs = [threading.Thread(target=post, args=("running", "/v1/videos/sync", long_job))]
    jobs[0].start()
    time.sleep(1.0)  # running
    jobs += [threading.Thread(target=post, args=("queued", "/v1/videos/sync", {**long_job, "seed": "1"}))]
    jobs[1].start()
    queued_async = client.post("/v1/videos", data={**long_job, "seed": "2"}).json()["id"]
    time.sleep(0.3)
    exit_s = world.terminate(timeout=30)
    for t in jobs:
        t.join(30)
    assert exit_s <= 10.0, exit_s
    typed(replies["queued"], 503, code="not_ready")
    running = replies["running"]
    assert running.status_code == 200 or typed(running, 503, code="not_ready")
    assert queued_async.startswith("video_gen_")
    client.close()
