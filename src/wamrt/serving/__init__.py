"""Policy server: openpi websocket, `/v1/policy/infer`, vLLM-Omni `/v1/videos`, one batched engine.

Import `build_app` / `ServerThread` from here; the modules need the `server` extra
(starlette, uvicorn, websockets, msgpack, prometheus-client, python-multipart). They are imported on first use, so
the parts without a web stack (`serving.config`'s engine settings, which `wamrt eval grid` reads) load without it.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it, imported on first access
_LAZY = {"build_app": ".app", "ServeConfig": ".config", "ServerThread": ".server"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
