"""Connection hygiene and graceful shutdown around uvicorn.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), header size (`h11_max_incomplete_event_size`)
and dead websockets (`ws_ping_interval` / `ws_ping_timeout`), but a socket that connects and sends nothing, or
sends its request head one byte at a time, stays open for good, and `limit_concurrency` does not count websocket
upgrades. `guarded_h11` adds both: a deadline for every request head (from the connection or from the first byte
of the next request) and a cap on open connections, HTTP and websocket together (past it: a typed 429 and close).
Slow bodies are bounded by `body.read_body`, idle websockets by `openpi_ws`.

`DrainingServer` turns SIGTERM into a drain (`Service.drain`): it stops accepting, lets accepted policy work
finish and be answered, cancels generation jobs by a deadline, answers everything else with a typed 503, and
hands the remaining grace to uvicorn's own shutdown, so the process exits within `--shutdown-grace-s`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import Busy


def guarded_h11(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and an open-connection cap."""
    refusal = json.dumps(Busy(f"more than {max_connections} open connections (--max-connections)").body()).encode()
    refusal = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: " + str(len(refusal)).encode() + b"\r\n\r\n" + refusal)

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(refusal)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()  # the first bytes of a request head: the head must be complete by the deadline
            super().data_received(data)
            if not self._between_requests() or self.transport.get_protocol() is not self:
                self._disarm()  # a head arrived (or the socket became a websocket)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if (self._between_requests() and self.transport.get_protocol() is self
                    and not self.transport.is_closing()):
                self.transport.close()

    return GuardedH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGTERM, SIGINT, `should_exit`) first drains the service."""

    def __init__(self, config: uvicorn.Config, service: Any, grace_s: float) -> None:
        super().__init__(config)
        self.service, self.grace_s = service, grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        deadline = time.monotonic() + self.grace_s
        for server in getattr(self, "servers", []):
            server.close()  # stop accepting before anything else
        # Most of the grace for the work already accepted; the rest for uvicorn to close the connections and
        # for the lifespan shutdown (engine threads).
        await self.service.drain(deadline - min(2.0, self.grace_s / 4))
        self.config.timeout_graceful_shutdown = max(0.1, deadline - time.monotonic() - 0.5)  # type: ignore[assignment]
        await super().shutdown(sockets)
