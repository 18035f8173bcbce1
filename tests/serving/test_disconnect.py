"""Clients that hang up mid-request leave nothing behind: queue drained, no job / connection / task
objects left, and memory flat over many disconnect cycles (websocket on both paths, HTTP infer,
forward-dynamics /v1/videos/sync), all while the engine is busy."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import time
import tracemalloc
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
import pytest
from oracle.fake_policy import FakePolicy
from PIL import Image
from websockets.sync.client import connect

from wamrt.client.wire import packb
from wamrt.sample import sample_observation
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.batcher import Job

MSGPACK = {"content-type": "application/msgpack"}
# gc.get_objects() touches lazy torch attributes that warn on access.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
VLLM = "/v1/realtime/robot/openpi"
WARMUP_CYCLES, CYCLES = 10, 100  # 400 abandoned requests measured (~11 s under tracemalloc)
# Bound on traced Python memory growth over CYCLES cycles after warm-up. One leaked observation per
# request would cost 4 x ~20 kB per cycle (~8 MB over the run); 2 MB allows interpreter noise only.
MAX_GROWTH_BYTES = 2 * 2**20


def _small_obs() -> dict[str, Any]:
    obs = sample_observation(0)
    for key in ("observation/wrist_image_left", "observation/exterior_image_1_left",
                "observation/exterior_image_2_left"):
        obs[key] = np.ascontiguousarray(obs[key][::8, ::8])
    return obs


def _fd_request() -> tuple[dict[str, str], dict[str, Any]]:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, format="PNG")
    extra = {"action_mode": "forward_dynamics", "action": [[0.0] * 10] * 4, "image_size": 256}
    return {"prompt": "p", "extra_params": json.dumps(extra)}, {"input_reference": ("f.png", buf.getvalue())}


def _cycle(server: ServerThread, http: httpx.Client, blob: bytes, fd: tuple[dict, dict]) -> int:
    """Open 2 sockets (both paths) + 2 HTTP requests (infer, FD sync), hang all of them up before their
    replies. Returns the number of requests sent."""
    with ExitStack() as stack:
        for path in ("", VLLM):
            ws = stack.enter_context(connect(server.ws_url + path, max_size=None, open_timeout=10))
            ws.recv()  # handshake
            ws.send(blob)
        for kind in ("infer", "fd"):
            try:
                if kind == "infer":
                    http.post("/v1/policy/infer", content=blob, headers=MSGPACK, timeout=0.005)
                else:
                    http.post("/v1/videos/sync", data=fd[0], files=fd[1], timeout=0.005)
            except httpx.TimeoutException:
                pass  # the client gave up: httpx drops the connection
    return 4  # leaving the stack closes both sockets


def _live(kind: type) -> int:
    return sum(isinstance(o, kind) for o in gc.get_objects())


def _pending_tasks() -> int:
    return sum(isinstance(o, asyncio.Task) and not o.done() for o in gc.get_objects())


def _drain(server: ServerThread, timeout: float = 10.0) -> None:
    s, deadline = server.service, time.monotonic() + timeout
    while (s.batcher.depth or s.batcher.in_flight or s.connections) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # let cancelled handlers finish their `finally`


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_disconnect_cycles_leave_no_jobs_and_flat_memory() -> None:
    policy = FakePolicy(delay=0.02)  # every request occupies the engine: the rest wait in the queue
    blob, fd = packb(_small_obs()), _fd_request()
    with ServerThread(policy, ServeConfig(max_batch=1, max_wait_ms=0, max_queue=256)) as server, \
            httpx.Client(base_url=server.http_url) as http:
        for _ in range(WARMUP_CYCLES):
            _cycle(server, http, blob, fd)
        _drain(server)
        gc.collect()
        tasks_before, rss_before = _pending_tasks(), _rss_bytes()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            calls_before, sent = len(policy.calls) + len(policy.generic_threads), 0
            for _ in range(CYCLES):
                sent += _cycle(server, http, blob, fd)
            _drain(server)
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        rss_growth = _rss_bytes() - rss_before
        service = server.service
        # Queue drained, nothing running, no websocket connection left registered.
        assert service.batcher.depth == 0 and service.batcher.in_flight == 0
        assert not service.connections
        assert not server.app.state.video_jobs.tasks and not server.app.state.video_jobs.records
        # No job objects alive anywhere (the queue, futures, closures), no handler tasks left running.
        assert _live(Job) == 0
        assert _pending_tasks() <= tasks_before
        # Abandoned queued requests were dropped, not executed: far fewer engine calls than requests.
        executed = len(policy.calls) + len(policy.generic_threads) - calls_before
        assert executed < sent * 0.8, (executed, sent)
        assert growth < MAX_GROWTH_BYTES, f"traced memory grew {growth / 2**20:.2f} MiB over {CYCLES} cycles"
        assert rss_growth < 64 * 2**20, f"RSS grew {rss_growth / 2**20:.1f} MiB"
        # The server still answers normally.
        r = http.post("/v1/policy/infer", content=blob, headers=MSGPACK, timeout=30)
        assert r.status_code == 200
        assert 'wamrt_queue_depth 0.0' in http.get("/metrics").text


def test_a_refused_request_frees_its_body_without_the_cycle_collector() -> None:
    """A handled error's traceback holds its handler's frames and they the request body: without
    `drop_tracebacks` every refused 1 MB body stayed in the C heap until a full collection (minutes apart under
    load). Collector off, 30 refused bodies: the heap in use must not grow by their size."""
    import http.client

    from wamrt.serving.errors import InvalidRequest, drop_tracebacks
    from wamrt.serving.heap import heap_stats

    class Body:  # a weak-referenceable stand-in for a request body
        pass

    def handler(drop: bool) -> Any:
        import weakref

        body = Body()
        ref = weakref.ref(body)
        try:
            raise InvalidRequest("bad", field="prompt")
        except InvalidRequest as exc:
            err = exc  # noqa: F841  # as the serving handlers keep it: the frame <-> traceback cycle
            if drop:
                drop_tracebacks(exc)
        return ref

    bad = {**sample_observation(0), "prompt": 7, "pad": b"\0" * 2**20}  # a 1 MB body whose prompt is not a string
    blob = packb(bad)
    gc.collect()
    gc.disable()
    try:
        assert handler(drop=False)() is not None  # the cycle this guards against, as Python makes it
        assert handler(drop=True)() is None
        gc.collect()
        stats = heap_stats()
        assert stats is not None, "glibc's mallinfo2 is missing: the CI image runs glibc >= 2.33"
        with ServerThread(FakePolicy(), ServeConfig()) as server:
            conn = http.client.HTTPConnection("127.0.0.1", server.config.port, timeout=30)
            for _ in range(3):  # warm: the parse pool's threads and their arenas
                conn.request("POST", "/v1/policy/infer", body=blob, headers=MSGPACK)
                assert conn.getresponse().read() and True
            before = heap_stats()["in_use"]
            for _ in range(30):
                conn.request("POST", "/v1/policy/infer", body=blob, headers=MSGPACK)
                reply = conn.getresponse()
                assert reply.status == 400, reply.read()
                reply.read()
            time.sleep(0.2)
            grown = heap_stats()["in_use"] - before
            conn.close()
        assert grown < 10 * 2**20, f"{grown / 2**20:.1f} MB kept by 30 refused 1 MB bodies"
    finally:
        gc.enable()
