"""What tests/serving/test_abuse*.py share: the measurement of one attack (`under_attack`: /healthz polled from
another process, a concurrent policy probe, the server's peak RSS), the typed-error check, FakePolicy servers in
their own processes, and the attackers' payloads."""

from __future__ import annotations

import io
import json
import re
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from PIL import Image

from wamrt.bench.server_process import ServerProcess
from wamrt.client.wire import packb, unpackb
from wamrt.sample import sample_observation

RSS_BOUND = 300 * 2**20  # server peak RSS growth per case
HEALTH_MS = 100.0  # every /healthz poll while a bad request is handled
STALL_FACTOR = 2.0  # a concurrent policy request vs its solo latency ...
# ... plus this much: on the 2-core CI box the server's refusal of an 8 MB body shares the two cores with the attacking
# client, the poller and the probe. The msgpack-of-empty-maps case measured 0.33-0.36 s against 0.15-0.17 s solo
# in all three attempts of one CI run (ea07e0d) and passed in the others; the stalls the issue reported were 1.7-26 s.
STALL_SLACK_S = 0.1
# Timing bars hold for the best of this many attempts of a case: the 2-core box is shared (load average 10-17),
# where the scheduler alone delays a poll by up to a second now and then; a real stall (the were 1.7-26 s)
# fails every attempt. Status and RSS bars hold for every attempt.
ATTEMPTS = 3
MSGPACK = {"content-type": "application/msgpack"}
VLLM = "/v1/realtime/robot/openpi"
MB = 2**20
HEAP_ADDRESS = re.compile(r"0x[0-9a-f]{6,}")  # 0x7f3a9c1e2b50 (not the "0x1088" of "1920x1088")


def stalled(policy_s: float | None, solo_s: float) -> bool:
    """A concurrent policy request that never answered, or took more than the bar against its solo latency."""
    return policy_s is None or policy_s > STALL_FACTOR * solo_s + STALL_SLACK_S


def fake_server(delay: float = 0.0, **config: Any) -> ServerProcess:
    """A FakePolicy server (`oracle.fake_server`) in its own process."""
    import os
    import sys

    from wamrt.net import free_port

    port = free_port()
    spec = {"delay": delay, "config": {"host": "127.0.0.1", "port": port, **config}}
    return ServerProcess([sys.executable, "-m", "oracle.fake_server", json.dumps(spec)], port,
                         env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})


# --- measuring one case ------------------------------------------------------------------------------------

@dataclass
class Report:
    health_ms: list[float] = field(default_factory=list)  # /healthz latencies while the attack ran
    rss_growth: int = 0
    policy_s: float | None = None  # the concurrent policy request's latency
    solo_s: float | None = None  # the same request alone, around the case (the box's load drifts)

    def timing_problems(self, min_polls: int) -> list[str]:
        out = []
        if len(self.health_ms) < min_polls:
            out.append(f"only {len(self.health_ms)} /healthz polls during the attack")
        slow = sorted(ms for ms in self.health_ms if ms > HEALTH_MS)
        if slow:
            out.append(f"/healthz polls over {HEALTH_MS:g} ms: {slow}")
        if self.solo_s is not None and stalled(self.policy_s, self.solo_s):
            out.append(f"policy request took {self.policy_s} s, solo {self.solo_s:.2f} s")
        return out


def checked(server: ServerProcess, attack: Callable[[], Any], verify: Callable[[Any], Any], *, probe: bool = False,
            min_polls: int = 0) -> Any:
    """`attack` under `under_attack`, up to ATTEMPTS times: `verify(result)` (asserting, or returning a bool) and
    the RSS bound must hold every time, the timing bars (/healthz, the policy probe) once. Returns the result."""
    failures = []
    for _ in range(ATTEMPTS):
        result, report = under_attack(server, attack, probe=probe)
        assert verify(result) is not False, f"unexpected result: {result!r:.300}"  # a lambda's False fails
        assert report.rss_growth <= RSS_BOUND, f"server RSS grew {report.rss_growth / MB:.0f} MB"
        problems = report.timing_problems(min_polls)
        if not problems:
            return result
        failures.append(problems)
    raise AssertionError(f"timing bars missed in all {ATTEMPTS} attempts: {failures}")


# /healthz is polled from a process of its own: in this one, the threads sending the attack hold the GIL for
# tens of milliseconds at a time and would be measured instead of the server.
_POLLER = """
import http.client, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
print("up", flush=True)
while True:
    t0 = time.perf_counter()
    conn.request("GET", "/healthz")
    r = conn.getresponse(); r.read()
    assert r.status == 200
    print(f"{1e3 * (time.perf_counter() - t0):.2f}", flush=True)
    time.sleep(0.02)
"""


def under_attack(server: ServerProcess, attack: Callable[[], Any], *, probe: bool = False) -> tuple[Any, Report]:
    """Run `attack` while another process polls /healthz and (with `probe`) a thread sends a good policy
    request, compared with the median of three sent alone just before (and, if it was slower than
    past the stall bar, three more just after: the shared box's load drifts by more than 2x within a
    minute). The server's RSS peak is measured over the whole case."""
    import subprocess
    import sys

    report = Report()
    prober_client = httpx.Client(base_url=server.url, timeout=60)
    if probe:
        report.solo_s = statistics.median(policy_latency(server, prober_client) for _ in range(3))
    server.reset_peak()
    base = server.rss()
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, str(server.port)], stdout=subprocess.PIPE, text=True)
    assert poller.stdout is not None and poller.stdout.readline().strip() == "up"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(poller.stdout))  # type: ignore[arg-type]
    reader.start()

    def policy() -> None:
        time.sleep(0.05)  # the bad request is on its way
        report.policy_s = policy_latency(server, prober_client)

    prober = threading.Thread(target=policy)
    if probe:
        prober.start()
    try:
        result = attack()
    finally:
        polled = len(lines)  # the polls answered while the attack ran
        if probe:
            prober.join(60)
        poller.kill()
        poller.wait()
        reader.join(10)
    report.health_ms = [float(x) for x in lines[:polled]]
    report.rss_growth = server.peak() - base
    if probe and report.policy_s is not None and report.solo_s is not None and stalled(report.policy_s, report.solo_s):
        report.solo_s = max(report.solo_s, statistics.median(policy_latency(server, prober_client) for _ in range(3)))
    prober_client.close()
    return result, report


OBS = sample_observation(0)


OBS_BLOB = packb(OBS)


def policy_latency(server: ServerProcess, client: httpx.Client) -> float:
    """One good /v1/policy/infer request on a client made beforehand (making one costs tens of ms of this
    process's GIL, an SSL context included, which the attack threads also want)."""
    t0 = time.perf_counter()
    r = client.post("/v1/policy/infer", content=OBS_BLOB, headers=MSGPACK)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def typed(r: httpx.Response, status: int, field: str | None = None, code: str | None = None) -> dict[str, Any]:
    body = unpackb(r.content) if r.headers.get("content-type") == "application/msgpack" else r.json()
    assert r.status_code == status, (r.status_code, body)
    assert body["type"] == "error" and not HEAP_ADDRESS.search(body["message"]) and "\n" not in body["message"], body
    if field is not None:
        assert body.get("field") == field, body
    if code is not None:
        assert body["code"] == code, body
    return body


def errors_total(server: ServerProcess, code: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'wamrt_errors_total{{code="{code}"}}'):
            return float(line.split()[-1])
    return 0.0


def temp_files(server: ServerProcess) -> list[str]:
    """Open files of the server that are temporary (deleted, or under /tmp), stdout/stderr aside."""
    import os

    out = []
    for fd in os.listdir(f"/proc/{server.pid}/fd"):
        if int(fd) > 2:
            try:
                target = os.readlink(f"/proc/{server.pid}/fd/{fd}")
            except OSError:
                continue
            if "(deleted)" in target or target.startswith("/tmp"):
                out.append(target)
    return out


# --- payloads ---------------------------------------------------------------------------------------------

def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A 69-byte PNG whose header claims width x height (one empty IDAT)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")



def empty_maps_msgpack(total_bytes: int) -> bytes:
    """An array of arrays of 65 535 empty maps (each within msgpack's own per-container limits)."""
    inner = b"\xdc\xff\xff" + b"\x80" * 65535
    n = total_bytes // len(inner)
    return b"\xdd" + struct.pack(">I", n) + inner * n


def nested_list_json(total_bytes: int) -> bytes:
    n = total_bytes // len(b"[0,0,0],")
    return (b'{"prompt": "pick up the cup", "observation/image": [' + b"[0,0,0]," * n + b'[0,0,0]], '
            b'"observation/joint_position": [0,0,0,0,0,0,0], "observation/gripper_position": 0}')


def chunked_post(url: str, path: str, content_type: str, total: int, *, head: bytes = b"",
                 piece: int = 1 << 20) -> tuple[int, bytes, int]:
    """POST `head` + zeros with Transfer-Encoding: chunked (no Content-Length) until the server answers and
    closes, or `total` bytes are sent; returns (status, body, bytes sent)."""
    host, port = url.removeprefix("http://").split(":")
    reply = bytearray()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        def read() -> None:
            try:
                while chunk := s.recv(65536):
                    reply.extend(chunk)
            except OSError:
                pass

        reader = threading.Thread(target=read)
        reader.start()
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\n"
                  "transfer-encoding: chunked\r\n\r\n".encode())
        sent, block = 0, head or b"0" * piece
        try:
            while sent < total and not reply:
                s.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n")
                sent += len(block)
                block = b"0" * piece
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed
        reader.join(60)
    head_bytes, _, body = bytes(reply).partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), body, sent




def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closed `sock` (EOF or reset) within `timeout`; whatever it sent first is read."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # closed by the server already: what the case wants

