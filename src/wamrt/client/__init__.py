"""Clients for a `wamrt serve` server and the openpi numpy-over-msgpack wire format."""

from .wire import WireError, packb, unpackb
from .ws import PolicyClient, ServerError

__all__ = ["PolicyClient", "ServerError", "WireError", "packb", "unpackb"]
