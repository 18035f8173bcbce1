"""A small synchronous openpi-websocket client (what `wamrt bench load` lanes and tests use).

It speaks the openpi dict dialect on `/`: first frame = metadata, then strictly alternating
request/reply. Errors arrive as a text frame holding JSON `{"type": "error", "code", "message"}`
(openpi clients see any text frame as an error), or as a msgpack map with `type: "error"` on the
vLLM-Omni path; both become `ServerError` and the socket stays usable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, Self

from websockets.sync.client import ClientConnection, connect

from .wire import packb, unpackb


class ServerError(RuntimeError):
    """A typed error reply from the server (`code` is e.g. `busy`, `invalid_request`, `stale`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def _error_from_text(text: str) -> ServerError:
    try:
        body = json.loads(text)
        return ServerError(str(body.get("code", "error")), str(body.get("message", text)))
    except (ValueError, AttributeError):
        return ServerError("error", text)


class PolicyClient:
    """`PolicyClient("ws://127.0.0.1:8000")`: `.metadata`, `.infer(obs) -> dict`, `.reset()`."""

    def __init__(self, url: str, *, api_key: str | None = None, open_timeout: float = 10.0,
                 max_size: int | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # Entered through an ExitStack: websockets >= 17 warns about connections used outside `with`.
        self._stack = ExitStack()
        self._ws: ClientConnection = self._stack.enter_context(connect(
            url, additional_headers=headers, compression=None, max_size=max_size, open_timeout=open_timeout))
        first = self._ws.recv()
        if isinstance(first, str):
            raise _error_from_text(first)
        self.metadata: dict[str, Any] = unpackb(first)

    def infer(self, obs: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        self._ws.send(packb(dict(obs)))
        return self._reply(timeout)

    def reset(self, *, timeout: float | None = None) -> Any:
        self._ws.send(packb({"endpoint": "reset"}))
        return self._reply(timeout)

    def _reply(self, timeout: float | None) -> Any:
        reply = self._ws.recv(timeout=timeout)
        if isinstance(reply, str):
            if reply == "reset successful":  # RoboArena's text reset reply
                return reply
            raise _error_from_text(reply)
        out = unpackb(reply)
        if isinstance(out, dict) and out.get("type") == "error":
            raise ServerError(str(out.get("code", "error")), str(out.get("message", "")))
        return out

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
