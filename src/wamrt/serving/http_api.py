"""Plain HTTP surface: `POST /v1/policy/infer` (msgpack or JSON), metadata, probes, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..client.wire import json_array, packb, to_jsonable
from .body import read_body
from .errors import Cancelled, InvalidRequest, ServingError, UnsupportedMediaType
from .limits import Limits, loads_json
from .logs import log_request
from .service import InferOutcome, Service, new_request_id

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
T = TypeVar("T")


def service_of(request: Request) -> Service:
    return request.app.state.service


def is_msgpack(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() in MSGPACK_TYPES


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client hangs up first (its queued job is then dropped)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise Cancelled("client disconnected")
        return task.result()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def decode_json_observation(body: bytes, limits: Limits) -> Any:
    msg = loads_json(body, limits=limits)
    if not isinstance(msg, dict):
        raise InvalidRequest("request must be a JSON object")
    return {k: json_array(v, k, max_pixels=limits.image_pixels)
            if k not in ("params", "prompt", "session_id", "endpoint") else v for k, v in msg.items()}


def parse_policy_body(service: Service, body: bytes, use_msgpack: bool) -> Any:
    """A `/v1/policy/infer` body -> a checked request (parse pool)."""
    if use_msgpack:
        return service.policy_frame(body)
    return service.policy_request(decode_json_observation(body, service.limits))


# After these the rest of the body is not read: the connection is closed rather than drained.
_CLOSE_AFTER = ("payload_too_large", "request_timeout")


def error_response(err: ServingError, *, msgpack: bool, request_id: str | None = None) -> Response:
    body = err.body(request_id)
    headers = {"X-Request-Id": request_id} if request_id else {}
    if err.code in _CLOSE_AFTER:
        headers["Connection"] = "close"
    if msgpack:
        return Response(packb(body), status_code=err.status, media_type=MSGPACK_TYPES[0], headers=headers)
    return JSONResponse(body, status_code=err.status, headers=headers)


def outcome_body(out: InferOutcome) -> dict[str, Any]:
    return {"request_id": out.request_id, "actions": out.actions, "timing": out.timing, "metadata": out.metadata}


async def policy_infer(request: Request) -> Response:
    service = service_of(request)
    received = time.monotonic()
    rid = new_request_id()
    use_msgpack = is_msgpack(request.headers.get("content-type"))
    try:
        ctype = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if not use_msgpack and ctype not in ("application/json", ""):
            raise UnsupportedMediaType(f"send application/msgpack or application/json, not {ctype!r}")
        body = await read_body(request, service.limits)
        req = await service.offload(parse_policy_body, service, body, use_msgpack)
        if req.endpoint == "reset":
            log_request(service, "http", rid, received, outcome="reset")
            reply: dict[str, Any] = {"status": "reset successful", "request_id": rid}
            return Response(packb(reply), media_type=MSGPACK_TYPES[0]) if use_msgpack else JSONResponse(reply)
        out = await until_disconnect(request, service.infer(req, surface="http", received=received,
                                                            request_id=rid))
    except Exception as exc:  # noqa: BLE001  # every failure becomes a typed error reply
        err = service.count_error(exc)
        log_request(service, "http", rid, received, error=err)
        return error_response(err, msgpack=use_msgpack, request_id=rid)
    log_request(service, "http", rid, received, batch_size=out.timing["batch_size"])
    headers = {"X-Request-Id": rid, "X-Inference-Time-S": f"{out.timing['total_ms'] / 1e3:.6f}"}
    if use_msgpack:
        return Response(packb(outcome_body(out)), media_type=MSGPACK_TYPES[0], headers=headers)
    return JSONResponse(to_jsonable(outcome_body(out)), headers=headers)


async def policy_metadata(request: Request) -> Response:
    meta = service_of(request).handshake()
    if is_msgpack(request.headers.get("accept")):
        return Response(packb(meta), media_type=MSGPACK_TYPES[0])
    return JSONResponse(to_jsonable(meta))


async def healthz(request: Request) -> Response:
    return PlainTextResponse("OK\n")


async def readyz(request: Request) -> Response:
    """200 or 503, `{"ready": ..., "warmup": {"seconds", "graphs"}}`: the warm-up's progress and nothing more for an
    anonymous caller (why not ready is logged; queue depth and errors are on the authenticated /metrics)."""
    s = service_of(request)
    ready, _why = s.readiness()
    return JSONResponse({"ready": ready, "warmup": s.public_warmup_state()}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    m = service_of(request).metrics
    return Response(m.render(), media_type=m.content_type)
