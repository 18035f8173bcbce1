"""Clients for a `wamrt serve` server, the openpi numpy-over-msgpack wire format, and the real-time runner.

Lazy: `wamrt.client.realtime` (numpy only) must import on a robot PC or a simulator lane without the server
extra (msgpack, websockets), which only the wire and the websocket client need.
"""

from typing import Any

__all__ = ["DelayEstimator", "LatencyModel", "PolicyClient", "RealtimeRunner", "ServerError", "SimClock",
           "WallClock", "WireError", "packb", "unpackb"]
_HOME = {"PolicyClient": "ws", "ServerError": "ws", "WireError": "wire", "packb": "wire", "unpackb": "wire",
         "RealtimeRunner": "realtime", "DelayEstimator": "realtime", "LatencyModel": "clocks", "SimClock": "clocks",
         "WallClock": "clocks"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        from importlib import import_module

        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module 'wamrt.client' has no attribute {name!r}")
