"""The requests of `wamrt bench soak`: good policy traffic on every surface, world generation, cancellations,
disconnects, malformed requests and plain reads, each a function of one client's `Session` that returns what
happened (`Outcome`). Kept apart from the runner (soak.py) so that the mix reads in one place.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from ..client.wire import packb, unpackb
from ..sample import sample_observation
from ..serving.media import encode_png

VLLM_PATH = "/v1/realtime/robot/openpi"
MSGPACK = {"content-type": "application/msgpack"}
POLICY_KINDS = ("ws_openpi", "ws_vllm", "http_msgpack", "http_json", "videos_sync_policy")


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status, or the one the error frame's code maps to (200: a reply; 0: no reply, by design)
    latency_ms: float
    calls: int = 1  # HTTP requests / websocket messages it took (polls, a DELETE)
    code: str | None = None  # the typed error's code


class Session:
    """One client: a keep-alive HTTP connection and one websocket per path, reopened when closed."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url, self.rng = url, rng
        self.http = httpx.Client(base_url=url, timeout=120)
        self._ws: dict[str, ClientConnection] = {}
        self._stack = contextlib.ExitStack()  # websockets' connect() is a context manager
        obs = sample_observation(0)
        self.obs_blob = packb(obs)
        self.obs_json = {k: {"b64": base64.b64encode(v.tobytes()).decode(), "dtype": "uint8", "shape": list(v.shape)}
                         if isinstance(v, np.ndarray) and v.dtype == np.uint8 else
                         v.tolist() if isinstance(v, np.ndarray | np.generic) else v for k, v in obs.items()}
        state = [*np.asarray(obs["observation/joint_position"]).tolist(), float(obs["observation/gripper_position"])]
        self.policy_form = {"prompt": obs["prompt"],
                            "extra_params": json.dumps({"action_mode": "policy", "action": state})}
        self.picture = encode_png(np.ascontiguousarray(obs["observation/wrist_image_left"][::4, ::4]))

    def ws(self, path: str) -> ClientConnection:
        conn = self._ws.get(path)
        if conn is None:
            conn = self._ws[path] = self._stack.enter_context(
                connect(self.url.replace("http", "ws", 1) + path, max_size=None, open_timeout=60))
            conn.recv(timeout=60)  # the handshake
        return conn

    def drop_ws(self, path: str) -> None:
        conn = self._ws.pop(path, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for path in list(self._ws):
            self.drop_ws(path)
        self._stack.close()
        self.http.close()


_CODES = {"invalid_request": 400, "unauthorized": 401, "not_found": 404, "payload_too_large": 413, "stale": 422,
          "busy": 429, "cancelled": 499, "internal_error": 500, "not_ready": 503}


def _timed(kind: str, fn: Callable[[], tuple[int, str | None]], calls: int = 1) -> Outcome:
    t0 = time.perf_counter()
    status, code = fn()
    return Outcome(kind, status, 1e3 * (time.perf_counter() - t0), calls, code)


def _http_status(r: httpx.Response) -> tuple[int, str | None]:
    code = None
    if r.status_code >= 400:
        try:
            body = unpackb(r.content) if r.headers.get("content-type") == MSGPACK["content-type"] else r.json()
            code = body.get("code")
        except Exception:  # noqa: BLE001  # a body that is no typed error: say so
            code = "untyped"
    return r.status_code, code


def _ws_request(s: Session, path: str, blob: bytes) -> tuple[int, str | None]:
    try:
        conn = s.ws(path)
        conn.send(blob)
        reply = conn.recv(timeout=120)
    except (WebSocketException, OSError, TimeoutError):
        s.drop_ws(path)
        return 599, "connection"  # counted as a server failure: nothing here closes a socket on purpose
    if isinstance(reply, str):  # openpi dialect error frame
        code = json.loads(reply).get("code")
        return _CODES.get(code, 500), code
    out = unpackb(reply)
    if isinstance(out, dict) and out.get("type") == "error":
        return _CODES.get(out.get("code"), 500), out.get("code")
    return 200, None


# --- good policy traffic ------------------------------------------------------------------------------------

def ws_openpi(s: Session) -> Outcome:
    return _timed("ws_openpi", lambda: _ws_request(s, "/", s.obs_blob))


def ws_vllm(s: Session) -> Outcome:
    return _timed("ws_vllm", lambda: _ws_request(s, VLLM_PATH, s.obs_blob))


def http_msgpack(s: Session) -> Outcome:
    return _timed("http_msgpack", lambda: _http_status(s.http.post("/v1/policy/infer", content=s.obs_blob,
                                                                   headers=MSGPACK)))


def http_json(s: Session) -> Outcome:
    return _timed("http_json", lambda: _http_status(s.http.post("/v1/policy/infer", json=s.obs_json)))


def videos_sync_policy(s: Session) -> Outcome:
    return _timed("videos_sync_policy", lambda: _http_status(s.http.post(
        "/v1/videos/sync", data=s.policy_form, files={"input_reference": ("c.png", s.picture)})))


def videos_async_policy(s: Session) -> Outcome:
    """POST /v1/videos, then poll the record until it is done."""
    t0, calls = time.perf_counter(), 1
    r = s.http.post("/v1/videos", data=s.policy_form, files={"input_reference": ("c.png", s.picture)})
    status, code = _http_status(r)
    if status == 200:
        vid = r.json()["id"]
        while True:
            rec = s.http.get(f"/v1/videos/{vid}")
            calls += 1
            if rec.status_code != 200 or rec.json()["status"] not in ("queued", "in_progress"):
                status, code = (rec.status_code, None) if rec.status_code != 200 else (
                    200 if rec.json()["status"] == "completed" else 500, (rec.json().get("error") or {}).get("code"))
                break
            time.sleep(0.05)
    return Outcome("videos_async_policy", status, 1e3 * (time.perf_counter() - t0), calls, code)


# --- world generation, cancellation, disconnects ----------------------------------------------------------------

_GEN = {"prompt": "a robot arm places a cup on a shelf", "size": "32x32", "num_frames": "5",
        "num_inference_steps": "1", "seed": "0"}


def generation_sync(s: Session) -> Outcome:
    return _timed("generation_sync", lambda: _http_status(s.http.post("/v1/videos/sync", data=_GEN)))


def image_generation(s: Session) -> Outcome:
    return _timed("image_generation", lambda: _http_status(s.http.post(
        "/v1/images/generations", json={**_GEN, "num_frames": None})))


def generation_cancel(s: Session) -> Outcome:
    """A longer generation job, deleted while queued or running: its record must say `cancelled`."""
    t0 = time.perf_counter()
    r = s.http.post("/v1/videos", data={**_GEN, "size": "64x64", "num_frames": "9", "num_inference_steps": "4"})
    status, code = _http_status(r)
    if status == 200:
        time.sleep(s.rng.uniform(0.0, 0.2))
        vid = r.json()["id"]
        d = s.http.delete(f"/v1/videos/{vid}")
        status, code = _http_status(d)
        s.http.delete(f"/v1/videos/{vid}")  # the record too
    return Outcome("generation_cancel", status, 1e3 * (time.perf_counter() - t0), 3, code)


def disconnect_ws(s: Session) -> Outcome:
    """A robot that sends a request and hangs up before the reply."""
    def go() -> tuple[int, str | None]:
        with connect(s.url.replace("http", "ws", 1), max_size=None, open_timeout=60) as conn:
            conn.recv(timeout=60)
            conn.send(s.obs_blob)
        return 0, None
    return _timed("disconnect_ws", go)


def disconnect_http(s: Session) -> Outcome:
    def go() -> tuple[int, str | None]:
        try:
            with httpx.Client(base_url=s.url, timeout=s.rng.uniform(0.005, 0.1)) as c:
                return _http_status(c.post("/v1/policy/infer", content=s.obs_blob, headers=MSGPACK))
        except httpx.TimeoutException:
            return 0, None
    return _timed("disconnect_http", go)


def read(s: Session) -> Outcome:
    path = s.rng.choice(["/healthz", "/readyz", "/v1/policy/metadata", "/v1/models", "/metrics"])
    return _timed("read", lambda: _http_status(s.http.get(path)))


# --- malformed requests (each a typed 4xx) ---------------------------------------------------------------------

def _bad_msgpack(s: Session) -> httpx.Response:
    return s.http.post("/v1/policy/infer", content=b"\xc1\xc1\xc1", headers=MSGPACK)


def _deep_json(s: Session) -> httpx.Response:
    return s.http.post("/v1/policy/infer", content=b"[" * 5000 + b"]" * 5000,
                       headers={"content-type": "application/json"})


def _empty_maps(s: Session) -> httpx.Response:
    inner = b"\xdc\xff\xff" + b"\x80" * 65535
    return s.http.post("/v1/policy/infer", content=b"\xdd\x00\x00\x00\x04" + inner * 4, headers=MSGPACK)


def _too_many_steps(s: Session) -> httpx.Response:
    return s.http.post("/v1/policy/infer", content=packb({**unpackb(s.obs_blob), "params": {"num_steps": 400}}),
                       headers=MSGPACK)


def _huge_guidance(s: Session) -> httpx.Response:
    return s.http.post("/v1/videos/sync", data={**_GEN, "guidance_scale": "1e308"})


def _underscore_frames(s: Session) -> httpx.Response:
    return s.http.post("/v1/videos", data={**_GEN, "num_frames": "1_3"})


def _empty_reference(s: Session) -> httpx.Response:
    return s.http.post("/v1/videos", data=_GEN, files={"input_reference": ("e.png", b"")})


def _bomb_picture(s: Session) -> httpx.Response:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    return s.http.post("/v1/videos", data=s.policy_form, files={"input_reference": ("b.png", png)})


def _long_prompt(s: Session) -> httpx.Response:
    return s.http.post("/v1/videos/sync", data={**_GEN, "prompt": "go " * 20_000})


def _declared_too_large(s: Session) -> httpx.Response:
    """A 1 TB Content-Length (httpx will not send one it does not have: a raw socket does)."""
    import socket

    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1099511627776\r\n\r\n{}")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return httpx.Response(int(head.split(b" ")[1]), content=body, headers={"content-type": "application/json"})


def _huge_size(s: Session) -> httpx.Response:
    return s.http.post("/v1/images/generations", json={**_GEN, "size": "8192x8192"})


def _future_timestamp(s: Session) -> httpx.Response:
    body = {**unpackb(s.obs_blob), "timestamp": time.time() + 3600, "max_age_ms": 100}
    return s.http.post("/v1/policy/infer", content=packb(body), headers=MSGPACK)


MALFORMED = (_bad_msgpack, _deep_json, _empty_maps, _too_many_steps, _huge_guidance, _underscore_frames,
             _empty_reference, _bomb_picture, _long_prompt, _declared_too_large, _huge_size, _future_timestamp)


def malformed(s: Session) -> Outcome:
    send = s.rng.choice(MALFORMED)

    out = _timed("malformed", lambda: _http_status(send(s)))
    out.kind = f"malformed{send.__name__}"
    return out


# The mix of one soak request (weights). Good policy traffic is what is measured; the rest is what a fleet,
# its operators and its attackers add. BAD: what the baseline replaces with a read, so that both phases carry
# the same good traffic at the same rate.
MIX: dict[str, tuple[float, Callable[[Session], Outcome]]] = {
    "ws_openpi": (0.09, ws_openpi), "ws_vllm": (0.07, ws_vllm), "http_msgpack": (0.08, http_msgpack),
    "http_json": (0.04, http_json), "videos_sync_policy": (0.04, videos_sync_policy),
    "videos_async_policy": (0.03, videos_async_policy), "generation_sync": (0.015, generation_sync),
    "image_generation": (0.01, image_generation), "generation_cancel": (0.015, generation_cancel),
    "disconnect_ws": (0.03, disconnect_ws), "disconnect_http": (0.03, disconnect_http),
    "malformed": (0.05, malformed), "read": (0.40, read),
}
BAD = ("malformed", "disconnect_ws", "disconnect_http", "generation_cancel")
