"""Request logs and /metrics for a fleet: every surface writes exactly one log line per answered request, carrying
the id its reply returned, in a format a log shipper parses (`--log-format json`); /metrics says what runs."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from oracle.generation_jobs import poll_job
from websockets.sync.client import connect

from wamrt.client.wire import packb, to_jsonable, unpackb
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.logs import JsonFormatter
from wamrt.serving.media import encode_png

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
FIELDS = {"ts", "level", "logger", "message", "surface", "request_id", "model", "batch_size", "latency_ms", "outcome",
          "status"}


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The request logger's records, formatted as `wamrt serve --log-format json` formats them."""
    stream, logger = io.StringIO(), logging.getLogger("wamrt.requests")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def lines_for(stream: io.StringIO, request_id: str) -> list[dict[str, Any]]:
    time.sleep(0.05)  # an async job logs on the server's loop, after its record turned "completed"
    records = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line parses
    return [r for r in records if r["request_id"] == request_id]


def one_line(stream: io.StringIO, request_id: str, surface: str, **want: Any) -> dict[str, Any]:
    found = lines_for(stream, request_id)
    assert len(found) == 1, f"{len(found)} log lines for {request_id}: {found}"
    line = found[0]
    assert set(line) == FIELDS and line["surface"] == surface and line["logger"] == "wamrt.requests"
    assert line["latency_ms"] > 0 and line["model"] == want.pop("model", "tiny-droid")
    for key, value in want.items():
        assert line[key] == value, (key, line)
    return line


def test_every_policy_surface_logs_one_line_with_the_reply_id(fake_server: ServerThread, obs: dict[str, Any],
                                                              json_log: io.StringIO) -> None:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    url = fake_server.http_url
    # openpi websocket, with the official client: a reply, then an error frame on the same socket
    reply = WebsocketClientPolicy(fake_server.ws_url).infer(obs)
    one_line(json_log, reply["request_id"], "ws", outcome="ok", status=200, batch_size=1)
    with connect(fake_server.ws_url, max_size=None) as ws:
        ws.recv()  # the handshake
        ws.send("not msgpack")
        err = json.loads(ws.recv())
    one_line(json_log, err["request_id"], "ws", outcome="invalid_request", status=400, level="info")
    # HTTP /v1/policy/infer: a reply and a typed error
    r = httpx.post(url + "/v1/policy/infer", content=packb(obs), headers={"content-type": "application/msgpack"})
    assert r.status_code == 200
    one_line(json_log, unpackb(r.content)["request_id"], "http", outcome="ok", batch_size=1)
    r = httpx.post(url + "/v1/policy/infer", json={"prompt": "no images"})
    assert r.status_code == 400
    one_line(json_log, r.json()["request_id"], "http", outcome="invalid_request", status=400)
    # /v1/videos/sync (a policy request in vLLM-Omni's form) and an async /v1/videos job
    state = [*obs["observation/joint_position"].tolist(), 0.1]
    form = {"prompt": "pick", "extra_params": json.dumps({"action": state})}
    composite = {"input_reference": ("c.png", encode_png(np.zeros((540, 640, 3), np.uint8)))}
    r = httpx.post(url + "/v1/videos/sync", data=form, files=composite)
    assert r.status_code == 200, r.text
    one_line(json_log, r.headers["x-request-id"], "videos_sync", outcome="ok", batch_size=1)
    job = httpx.post(url + "/v1/videos", data=form, files=composite).json()
    assert poll_job(url, job["id"])["status"] == "completed"
    one_line(json_log, job["id"], "videos", outcome="ok", batch_size=1)
    r = httpx.post(url + "/v1/videos/sync", data={"prompt": "a cat"})  # no world model here: a typed 400
    assert r.status_code == 400
    one_line(json_log, r.json()["request_id"], "videos_sync", outcome="invalid_request", status=400)
    assert r.headers["x-request-id"] == r.json()["request_id"]


def test_generation_surfaces_log_one_line_each(json_log: io.StringIO, tmp_path_factory: pytest.TempPathFactory) -> None:
    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    cfg = ServeConfig(model_name="tiny-world", steps=1, max_batch=2)
    with ServerThread(wamrt.load_policy("tiny-world", device="cpu"), cfg) as server:
        url = server.http_url
        r = httpx.post(url + "/v1/images/generations", json={"prompt": "a red cube", "size": "32x48",
                                                             "num_inference_steps": 1}, timeout=60)
        assert r.status_code == 200, r.text
        one_line(json_log, r.headers["x-request-id"], "images", model="tiny-world", outcome="ok", batch_size=1)
        r = httpx.post(url + "/v1/videos/sync", data={"prompt": "a pear", "size": "32x32", "num_frames": "5",
                                                      "num_inference_steps": "1"}, timeout=60)
        assert r.status_code == 200, r.text
        one_line(json_log, r.headers["x-request-id"], "videos_sync", model="tiny-world", outcome="ok")


def test_metrics_say_what_runs_and_how_the_process_is(fake_server: ServerThread) -> None:
    from wamrt import __version__

    text = httpx.get(fake_server.http_url + "/metrics").text
    build = re.search(r"^wamrt_build_info\{(.*)\} 1\.0$", text, re.M)
    assert build, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', build.group(1)))
    assert labels["version"] == __version__ and labels["model"] == "tiny-droid" and labels["recipe"] == "none"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", labels["git_sha"])
    rss = re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)
    assert rss and float(rss.group(1)) > 10 * 2**20  # a Python server holds tens of MB at least
    assert "process_cpu_seconds_total" in text and "python_info{" in text


def test_wamrt_serve_log_format_json_writes_only_json_lines(tmp_path: Any, obs: dict[str, Any]) -> None:
    """The real command: every stderr line (uvicorn's included) is one JSON object; a request adds its line."""
    from wamrt.net import free_port

    port = free_port()
    env = {**os.environ, "WAMRT_CACHE": os.environ.get("WAMRT_CACHE") or str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    server = subprocess.Popen([sys.executable, "-m", "wamrt", "serve", "--port", str(port), "--steps", "1",
                               "--log-format", "json", "--device", "cpu"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            time.sleep(0.5)
        body = json.loads(json.dumps(to_jsonable(obs)))
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/policy/infer", json=body, timeout=120).json()
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    records = [json.loads(line) for line in err.splitlines() if line.strip()]  # raises on any non-JSON line
    assert any(r["logger"].startswith("uvicorn") for r in records)
    mine = [r for r in records if r.get("request_id") == reply["request_id"]]
    assert len(mine) == 1 and mine[0]["surface"] == "http" and mine[0]["outcome"] == "ok"
    assert mine[0]["model"] == "tiny-droid" and mine[0]["batch_size"] == 1 and mine[0]["level"] == "info"


def test_chat_logs_one_line_per_completion(json_log: io.StringIO, tmp_path_factory: pytest.TempPathFactory) -> None:
    import openai

    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    cfg = ServeConfig(model_name="tiny-world", steps=1, max_batch=2, warmup_requests=0)
    with ServerThread(wamrt.load_policy("tiny-world", device="cpu"), cfg) as server:
        client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Hello robot"}]
        out = client.chat.completions.create(model="tiny-world", messages=messages, max_tokens=4)
        one_line(json_log, out.id, "chat", model="tiny-world", outcome="ok", status=200, batch_size=None)
        chunks = list(client.chat.completions.create(model="tiny-world", messages=messages, max_tokens=4,
                                                     stream=True))
        one_line(json_log, chunks[0].id, "chat", model="tiny-world", outcome="ok")
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny-world", messages=[], max_tokens=4)
        errors = [r for r in (json.loads(line) for line in json_log.getvalue().splitlines())
                  if r["surface"] == "chat" and r["outcome"] == "invalid_request"]
        assert len(errors) == 1 and errors[0]["status"] == 400 and errors[0]["request_id"].startswith("chatcmpl-")


def test_the_server_log_handler_follows_stderr(monkeypatch) -> None:
    """`configure_logging` writes to stderr as it is at each record: a stderr swapped and closed after the server
    configured logging (pytest's capture does that) neither errors nor swallows later lines."""
    from wamrt.serving.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging("info", "json")
        logging.getLogger("wamrt.test").info("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("wamrt.test").info("two")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert json.loads(second.getvalue())["message"] == "two"
