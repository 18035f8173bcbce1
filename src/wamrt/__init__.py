"""wamrt: World-Action Model runtime for NVIDIA Cosmos 3 checkpoints."""

from typing import Any

from ._version import __version__ as __version__  # re-exported: the one source is _version.py

__all__ = ["ActionChunk", "Policy", "RequestError", "SamplingOptions", "load_policy"]


def __getattr__(name: str) -> Any:
    # Lazy: `import wamrt` stays cheap (no diffusers/transformers import) until the API is used.
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'wamrt' has no attribute {name!r}")
