"""API-key check as a pure ASGI middleware, so HTTP and websocket handshakes share one rule.

Accepted: `Authorization: Bearer <key>` (RoboLab, TensorRT-LLM), `Authorization: Api-Key <key>`
(openpi-client), or `Api-Key: <key>` / `X-Api-Key: <key>`. Probes (/healthz, /readyz) stay open.
A refused websocket gets a real HTTP 401 with a JSON body when the server supports the ASGI
denial-response extension (uvicorn does), else a policy-violation close (client sees 403).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import Unauthorized

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for raw_name, raw_value in headers:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1").strip()
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() in ("bearer", "api-key"):
                return token.strip()
        elif name in ("api-key", "x-api-key"):
            return value
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, on_reject: Any = None) -> None:
        self.app, self.api_key, self.on_reject = app, api_key, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key is None or scope["type"] not in ("http", "websocket")
                or scope.get("path", "") in OPEN_PATHS):
            return await self.app(scope, receive, send)
        key = presented_key(scope.get("headers", []))
        if key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()):
            return await self.app(scope, receive, send)
        err = Unauthorized("missing or wrong API key (use 'Authorization: Bearer <key>' or 'Api-Key')")
        if self.on_reject:
            self.on_reject(err)
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer")]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})
