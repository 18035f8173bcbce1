"""Policy server: openpi websocket, `/v1/policy/infer`, vLLM-Omni `/v1/videos`, one batched engine.

Import `build_app` / `ServerThread` from here; the modules need the `server` extra
(starlette, uvicorn, websockets, msgpack, prometheus-client, python-multipart). They are imported on first use, so
the parts without a web stack (`serving.config`'s engine settings, which `wamrt eval grid` reads) load without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeConfig", "ServerThread", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from .app import build_app

        return build_app
    if name == "ServeConfig":
        from .config import ServeConfig

        return ServeConfig
    if name == "ServerThread":
        from .server import ServerThread

        return ServerThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
