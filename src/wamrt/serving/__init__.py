"""Policy server: openpi websocket, `/v1/policy/infer`, vLLM-Omni `/v1/videos`, one batched engine.

Import `build_app` / `ServerThread` from here; the modules need the `server` extra
(starlette, uvicorn, websockets, msgpack, prometheus-client, python-multipart).
"""

from .app import build_app
from .config import ServeConfig
from .server import ServerThread

__all__ = ["ServeConfig", "ServerThread", "build_app"]
