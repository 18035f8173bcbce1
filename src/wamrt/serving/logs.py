"""One log line per answered request, on every surface, and the server's log format (`--log-format text|json`).

A request line carries surface, request_id (the id the reply returns), model, batch size, latency and outcome, as
fields of the record; the text format prints them as key=value, the JSON format as top-level keys of one object
per line (what a log shipper indexes). The surfaces call `log_request` where they answer.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from typing import Any

from .errors import ServingError

request_log = logging.getLogger("wamrt.requests")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def log_request(service: Any, surface: str, request_id: str | None, received: float, *,
                batch_size: float | None = None, error: ServingError | None = None, outcome: str = "ok") -> None:
    """The line of one answered request: `received` = time.monotonic() when it arrived; `error` = the typed
    error it was answered with (its code becomes the outcome, its HTTP status the status)."""
    fields = {
        "surface": surface, "request_id": request_id, "model": service.config.model_name,
        "batch_size": None if batch_size is None else int(batch_size),
        "latency_ms": round(1e3 * (time.monotonic() - received), 2),
        "outcome": error.code if error is not None else outcome, "status": error.status if error is not None else 200,
    }
    level = logging.ERROR if error is not None and error.status >= 500 else logging.INFO
    request_log.log(level, "request " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
                    extra={"fields": fields})


def logged_reply(service: Any, surface: str, received: float, reply: Any, *, batch_size: float | None = 1) -> Any:
    """`log_request` for an HTTP reply that carries its id in `X-Request-Id`; returns the reply."""
    log_request(service, surface, reply.headers.get("x-request-id"), received, batch_size=batch_size)
    return reply


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ms), level, logger, message, the record's `fields`, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes, not as it was when the handler was made: a server started
    in a process that later swaps or closes its stderr (a test harness's capture, a notebook) would otherwise have
    its background threads log to a closed stream. (The stdlib's private `logging._StderrHandler` does the same.)"""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always sys.stderr


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """The root handler on stderr in `log_format`. With json, uvicorn is told not to configure its loggers
    (`server.uvicorn_config`), so its lines reach this handler and come out as JSON too."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
