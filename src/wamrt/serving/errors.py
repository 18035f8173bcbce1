"""Typed serving errors: one `code` string and one HTTP status per failure kind, shared by every surface."""

from __future__ import annotations

import re
from typing import Any

from ..client.wire import WireError
from ..pipeline.errors import RequestError


class ServeConfigError(ValueError):
    """A setting that cannot work; `flag` names the `wamrt serve` flag (the field is its snake_case form)."""

    def __init__(self, message: str, *, flag: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


MAX_MESSAGE_CHARS = 300  # a message echoing a request value (`got {value!r}`) never echoes megabytes back
_HEAP_ADDRESS = re.compile(r"\s*at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{8,}")  # `<... object at 0x7f...>`, bare addresses


def clean_message(text: str) -> str:
    """One line, no heap addresses, at most MAX_MESSAGE_CHARS: what a client may read of an error."""
    text = _HEAP_ADDRESS.sub("", " ".join(str(text)[: 4 * MAX_MESSAGE_CHARS].split()))
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


class ServingError(Exception):
    """An error the server reports to the client. `code` is stable API; `message` is for humans."""

    code = "internal_error"
    status = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        message = clean_message(message)
        super().__init__(message)
        self.message, self.field = message, None if field is None else clean_message(field)

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message}
        if self.field:
            out["field"] = self.field
        if request_id:
            out["request_id"] = request_id
        return out


class InvalidRequest(ServingError):
    code, status = "invalid_request", 400


class Unauthorized(ServingError):
    code, status = "unauthorized", 401


class NotFound(ServingError):
    code, status = "not_found", 404


class Conflict(ServingError):
    """The resource is not in a state that allows the request (e.g. the content of an unfinished job)."""

    code, status = "conflict", 409


class RequestTimeout(ServingError):
    """The body did not arrive within `--body-timeout-s`."""

    code, status = "request_timeout", 408


class PayloadTooLarge(ServingError):
    code, status = "payload_too_large", 413


class UnsupportedMediaType(ServingError):
    code, status = "unsupported_media_type", 415


class StaleObservation(ServingError):
    """The observation is older than the client's max age: rejected, never executed."""

    code, status = "stale", 422


class SafetyRejected(ServingError):
    """The action chunk broke the safety envelope and the envelope says `reject`."""

    code, status = "safety_rejected", 422


class Busy(ServingError):
    """The bounded queue is full: retry later (HTTP 429)."""

    code, status = "busy", 429


class NotAvailable(ServingError):
    """The request needs something this server was started without (an optional package such as PyAV)."""
    code, status = "not_available", 501


class NotReady(ServingError):
    code, status = "not_ready", 503


class Cancelled(ServingError):
    code, status = "cancelled", 499


class OutOfMemory(ServingError):
    """The device ran out of memory for this request, even run alone: retry later (the server keeps serving)."""

    code, status = "out_of_memory", 503


def as_serving_error(exc: BaseException) -> ServingError:
    """Map any failure to a typed error; internals never leak a traceback to the client."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, RequestError | WireError):
        return InvalidRequest(str(exc), field=exc.field)
    if type(exc).__name__ == "ClientDisconnect":  # starlette's, matched by name: settings and errors load without it
        return Cancelled("client disconnected")
    if isinstance(exc, FloatingPointError):
        return ServingError("the model produced non-finite actions")
    if type(exc).__name__ == "OutOfMemoryError":  # torch's (not imported here: the serving package loads without it)
        return OutOfMemory("the GPU ran out of memory for this request; retry, or lower the load (--max-batch, "
                           "--gpu-memory's plan)")
    return ServingError(f"internal inference error ({type(exc).__name__})")


def drop_tracebacks(exc: BaseException | None) -> None:
    """Forget the tracebacks of a handled `exc` and of its causes and contexts. A traceback holds the frames it
    passed through and each frame its locals -- a request body of megabytes, a decoded observation -- and the
    handler's own frame usually holds the exception back (`err = ...`): a reference cycle that only Python's full
    collection frees, minutes apart under load. The soak measured ~1 MB of C heap kept per refused or dropped
    request that way (docs/serving.md, soak)."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
