"""Issue 39, the connection side (findings 6-8, 11): a client that leaves, SIGTERM draining, head / body / idle
deadlines and the connection cap, the API-key and /readyz edges, against FakePolicy servers in processes of their
own (exact timing, SIGTERM). Shared measurement and payloads: tests/oracle/abuse.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from oracle.abuse import MSGPACK, OBS, OBS_BLOB, closed_by_server, fake_server, send_quietly, typed
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from wamrt.bench.server_process import ServerProcess
from wamrt.client.wire import packb, unpackb

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


HYGIENE = dict(header_timeout_s=2.0, body_timeout_s=2.0, keep_alive_s=1.0, ws_ping_s=1.0, ws_idle_s=4.0,
               max_connections=60)


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    """A FakePolicy server (0.5 s a batch, one request a batch) with short connection deadlines and a
    readiness stall bound under a batch's length."""
    with fake_server(delay=0.5, max_batch=1, max_wait_ms=0.0, max_queue=4, ready_stall_s=0.3, **HYGIENE) as server:
        yield server



def test_a_client_that_leaves_costs_no_engine_work(guarded: ServerProcess) -> None:
    """A max-step request queued behind three others (1.5 s of engine work), whose client hangs up: it never
    reaches the engine."""
    server = guarded
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=4)) as client:
        def batches() -> float:
            text = client.get("/metrics").text
            return float(next(line.split()[-1] for line in text.splitlines()
                               if line.startswith("wamrt_batch_seconds_count")))

        before = batches()
        ahead = [threading.Thread(target=lambda: client.post("/v1/policy/infer", content=OBS_BLOB, headers=MSGPACK))
                 for _ in range(3)]
        for t in ahead:
            t.start()
        time.sleep(0.1)
        with connect(server.ws_url, max_size=None) as ws:
            ws.recv()
            ws.send(packb({**OBS, "params": {"num_steps": 16}}))
            time.sleep(0.05)  # queued behind the three
        for t in ahead:
            t.join(30)
        time.sleep(0.7)
        assert batches() - before == 3  # the three only


def test_the_connection_cap(guarded: ServerProcess) -> None:
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(HYGIENE["max_connections"])]
    try:
        typed(httpx.get(guarded.url + "/healthz"), 429, code="busy")
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(guarded.url + "/healthz").status_code == 200


def test_slow_and_idle_connections_are_closed(guarded: ServerProcess) -> None:
    """Slow request heads, POSTs stalled mid-body, connect-only sockets and websockets that answer no ping:
    all closed within their deadlines (the issue's were all still open after 60 s)."""
    addr = ("127.0.0.1", guarded.port)
    t0 = time.monotonic()
    slow_heads = [socket.create_connection(addr) for _ in range(20)]
    for s in slow_heads:
        send_quietly(s, b"GET /healthz HTTP/1.1\r\nhost:")
    stalled = [socket.create_connection(addr) for _ in range(15)]
    for s in stalled:
        send_quietly(s, b"POST /v1/policy/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                 b"content-length: 100000\r\n\r\n" + b"\x80" * 10)
    silent = [socket.create_connection(addr) for _ in range(15)]
    mute_ws = []  # websockets that never answer a ping (raw sockets after the upgrade)
    for _ in range(8):
        s = socket.create_connection(addr)
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
                  b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
        mute_ws.append(s)
    for _ in range(3):  # a byte every 0.5 s: the heads are still not complete at their 2 s deadline
        time.sleep(0.5)
        for s in slow_heads:
            send_quietly(s, b"x")
    limit = HYGIENE["header_timeout_s"] + 3.0
    assert all(closed_by_server(s, limit) for s in slow_heads + silent)
    for s in stalled:  # a typed 408, then closed
        s.settimeout(limit)
        head = s.recv(65536)
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"408" and b"request_timeout" in head, head
        assert closed_by_server(s, limit)
    assert all(closed_by_server(s, limit) for s in mute_ws)  # ping at 1 s, no pong 1 s later
    assert time.monotonic() - t0 < 15.0
    for s in slow_heads + stalled + silent + mute_ws:
        s.close()
    with connect(guarded.ws_url, max_size=None) as ws:  # answers pings, but sends nothing: idle
        ws.recv()
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1001
    assert httpx.get(guarded.url + "/healthz").status_code == 200


# --- 7. SIGTERM drains -----------------------------------------------------------------------------------

def test_sigterm_answers_in_flight_requests_and_exits_within_the_grace() -> None:
    """Under load (0.4 s a batch, one at a time): every policy request accepted before the signal is answered
    (websocket: the reply, then close 1012), every later one on an open connection is a typed 503, a generation-
    free server exits within --shutdown-grace-s, and new connections are refused."""
    grace = 6.0
    server = fake_server(delay=0.4, max_batch=1, max_wait_ms=0.0, shutdown_grace_s=grace).start()
    try:
        results: dict[str, Any] = {}
        stack = contextlib.ExitStack()
        sockets = []
        for _ in range(3):
            ws = stack.enter_context(connect(server.ws_url, max_size=None, open_timeout=30))
            ws.recv()
            ws.send(OBS_BLOB)
            sockets.append(ws)
        client = httpx.Client(base_url=server.url, timeout=30)
        client.get("/healthz")  # an open keep-alive connection for the request after the signal

        def http(i: int) -> None:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                results[f"http{i}"] = c.post("/v1/policy/infer", content=OBS_BLOB, headers=MSGPACK)

        posts = [threading.Thread(target=http, args=(i,)) for i in range(3)]
        for t in posts:
            t.start()
        time.sleep(0.5)  # six requests accepted: one running, five queued (~2.4 s of work)
        exited: list[float] = []
        killer = threading.Thread(target=lambda: exited.append(server.terminate(timeout=30)))
        killer.start()
        time.sleep(0.3)
        late = client.post("/v1/policy/infer", content=OBS_BLOB, headers=MSGPACK)
        for t in posts:
            t.join(30)
        for i, ws in enumerate(sockets):
            out = unpackb(ws.recv(timeout=30))
            assert out.shape == (32, 8) if isinstance(out, np.ndarray) else out["actions"].shape == (32, 8)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
            assert ws.close_code == 1012, (i, ws.close_code)
        for i in range(3):
            assert results[f"http{i}"].status_code == 200, results[f"http{i}"].text
        typed(late, 503, code="not_ready")
        killer.join(30)
        assert exited and exited[0] <= grace, exited
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/healthz", timeout=2)
        client.close()
        stack.close()
    finally:
        server.stop()


# --- 11. auth and probes ----------------------------------------------------------------------------------

def test_an_empty_api_key_is_refused_at_startup(capsys: pytest.CaptureFixture[str]) -> None:
    from wamrt.cli import main
    from wamrt.serving import ServeConfig
    from wamrt.serving.server import warn_if_open

    assert main(["serve", "--api-key", "", "--model", "tiny-droid"]) == 2
    assert "--api-key" in capsys.readouterr().err
    warn_if_open(ServeConfig(host="0.0.0.0"))
    assert "WARNING" in capsys.readouterr().err
    warn_if_open(ServeConfig(host="0.0.0.0", api_key="k"))
    warn_if_open(ServeConfig(host="127.0.0.1"))
    assert capsys.readouterr().err == ""


def test_readyz_says_only_ready_and_turns_503_when_the_engine_is_stalled(guarded: ServerProcess) -> None:
    r = httpx.get(guarded.url + "/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True and set(r.json()) == {"ready", "warmup"}
    assert set(r.json()["warmup"]) <= {"seconds", "graphs"}  # progress only: no queue depth, no error text
    with httpx.Client(base_url=guarded.url, timeout=30) as c:
        running = threading.Thread(target=lambda: c.post("/v1/policy/infer", content=OBS_BLOB, headers=MSGPACK))
        running.start()
        seen = []
        while running.is_alive():  # the 0.5 s batch holds the engine past --ready-stall-s 0.3 for a while
            r = httpx.get(guarded.url + "/readyz")
            seen.append((r.status_code, r.json()["ready"]))
            time.sleep(0.03)
        running.join(30)
    assert (503, False) in seen, seen
    assert httpx.get(guarded.url + "/readyz").status_code == 200


def test_readyz_turns_503_while_the_queue_is_full() -> None:
    from oracle.fake_policy import FakePolicy

    from wamrt.sample import sample_observation
    from wamrt.serving import ServeConfig, ServerThread
    from wamrt.serving.batcher import Job

    with ServerThread(FakePolicy(delay=1.0), ServeConfig(max_batch=1, max_wait_ms=0.0, max_queue=2)) as server:
        # Straight into the batcher (HTTP requests on a loaded machine reach it too far apart to fill the queue):
        # one running, two queued, the queue is full.
        batcher = server.service.batcher
        futures = [batcher.submit(Job(sample_observation(0), 0, {}))]
        deadline = time.monotonic() + 5
        while batcher.depth and time.monotonic() < deadline:  # the first one taken by the engine thread
            time.sleep(0.01)
        futures += [batcher.submit(Job(sample_observation(i), 0, {})) for i in (1, 2)]
        assert batcher.depth == 2
        r = httpx.get(server.http_url + "/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False and "queue_depth" not in r.json()
        for f in futures:
            f.result(30)
        assert httpx.get(server.http_url + "/readyz").status_code == 200
