"""openpi websocket on `/` and `/v1/realtime/robot/openpi`, with per-message dialects.

* `/`, no `endpoint` key (openpi, Cosmos Framework, RoboLab): reply dict with `actions` and `action`,
  openpi's `server_timing`/`policy_timing`, the framework's `timing`, and `metadata`.
* `/`, message carries `endpoint` (RoboArena): reply the bare float32 [32, 8] array; reset -> text
  "reset successful".
* `/v1/realtime/robot/openpi` (vLLM-Omni): bare array unless `params.structured`; reset -> msgpack
  `{"status": "reset successful"}`; errors are msgpack `{"type": "error", ...}`.

Errors never close the socket: on `/` they are a text frame holding the JSON error (openpi clients
raise on any text frame, so they see the failure), on the vLLM path a msgpack error map. Only frames
over the size limit close it (1009, the websocket rule). A client that hangs up mid-request cancels
its queued job. Frames are decoded and checked in the parse pool (`Service.policy_frame`), off the event
loop. A socket silent for `--ws-idle-s` is closed (1001); during a shutdown drain a socket gets the reply of
its request in flight, then a close (1012, "service restart").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..client.wire import packb
from .errors import InvalidRequest, ServingError
from .logs import log_request
from .observation import ParsedRequest
from .service import InferOutcome, Service, new_request_id

VLLM_PATH = "/v1/realtime/robot/openpi"


@dataclass(eq=False)  # identity hash: the service keeps a set of open connections
class Connection:
    vllm: bool
    session_id: str | None = None
    fresh: bool = True  # next inference starts a session (first call, reset, new session_id)
    prev_total_ms: float | None = None
    busy: bool = False  # a request of this socket is being parsed, run or answered (a shutdown drain waits)


def _reply(conn: Connection, req: ParsedRequest, out: InferOutcome) -> Any:
    bare = req.had_endpoint and not conn.vllm or conn.vllm and not req.flags.get("structured")
    if bare:
        return out.actions
    t = out.timing
    return {
        "actions": out.actions, "action": out.actions, "request_id": out.request_id,
        "server_timing": {"infer_ms": t["total_ms"], "prev_total_ms": conn.prev_total_ms},
        "policy_timing": {"infer_ms": t["model_ms"]},
        "timing": {"server_preprocess_ms": t["preprocess_ms"], "server_policy_inference_ms": t["model_ms"],
                   "server_postprocess_ms": t["postprocess_ms"], "server_total_ms": t["total_ms"],
                   "queue_ms": t["queue_ms"], "batch_size": t["batch_size"]},
        "metadata": out.metadata,
    }


async def _send_error(ws: WebSocket, conn: Connection, err: ServingError, rid: str | None) -> None:
    body = err.body(rid)
    if conn.vllm:
        await ws.send_bytes(packb(body))
    else:
        await ws.send_text(json.dumps(body))


async def openpi_socket(ws: WebSocket) -> None:
    service: Service = ws.app.state.service
    conn = Connection(vllm=ws.url.path.rstrip("/") == VLLM_PATH)
    pending: asyncio.Task | None = None  # a receive started while an inference was running
    service.connections.add(conn)
    try:
        await ws.accept()
        await ws.send_bytes(packb(service.handshake()))
        while True:
            if service.draining:
                await _close(ws, 1012)  # after the reply of the last request: the drain is done with this socket
                return
            pending = pending or asyncio.ensure_future(ws.receive())
            done, _ = await asyncio.wait({pending}, timeout=service.config.ws_idle_s)
            if not done:
                await _close(ws, 1001, "idle")
                return
            message, pending = pending.result(), None
            if message["type"] == "websocket.disconnect":
                return
            received = time.monotonic()
            rid = new_request_id("ws")
            conn.busy = True
            try:
                if message.get("bytes") is None:
                    raise InvalidRequest("send binary msgpack frames, not text")
                req = await service.offload(service.policy_frame, message["bytes"])
                if req.endpoint == "reset" or req.reset:
                    conn.fresh, conn.session_id = True, req.session_id or conn.session_id
                if req.endpoint == "reset":
                    await _send_reset(ws, conn)
                    log_request(service, "ws", rid, received, outcome="reset")
                    continue
                if req.session_id is not None and req.session_id != conn.session_id:
                    conn.fresh, conn.session_id = True, req.session_id
                req.session_id = req.session_id or conn.session_id
                work = asyncio.ensure_future(service.infer(req, surface="ws", received=received, request_id=rid))
                pending = asyncio.ensure_future(ws.receive())
                done, _ = await asyncio.wait({work, pending}, return_when=asyncio.FIRST_COMPLETED)
                if pending in done and pending.result()["type"] == "websocket.disconnect":
                    work.cancel()  # client gone: drop its queued job
                    return
                if pending.done():  # pipelined frame: handle after this reply
                    pending = asyncio.ensure_future(asyncio.sleep(0, pending.result()))
                out = await work
                out.metadata["reset"] = conn.fresh
                conn.fresh = False
                await ws.send_bytes(packb(_reply(conn, req, out)))
                conn.prev_total_ms = 1e3 * (time.monotonic() - received)
                log_request(service, "ws", rid, received, batch_size=out.timing["batch_size"])
            except (WebSocketDisconnect, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001  # typed error frame; the socket lives on
                err = service.count_error(exc)
                log_request(service, "ws", rid, received, error=err)
                await _send_error(ws, conn, err, rid)
            finally:
                conn.busy = False
    except WebSocketDisconnect:
        return
    finally:
        service.connections.discard(conn)
        if pending is not None and not pending.done():
            pending.cancel()


async def _close(ws: WebSocket, code: int, reason: str = "") -> None:
    """Close from the server side; a peer that left meanwhile is not an error."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.close(code, reason)


async def _send_reset(ws: WebSocket, conn: Connection) -> None:
    if conn.vllm:
        await ws.send_bytes(packb({"status": "reset successful"}))
    else:
        await ws.send_text("reset successful")
