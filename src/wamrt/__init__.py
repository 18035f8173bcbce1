"""wamrt: World-Action Model runtime for NVIDIA Cosmos 3 checkpoints."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["ActionChunk", "Policy", "RequestError", "SamplingOptions", "load_policy"]


def __getattr__(name: str) -> Any:
    # Lazy: `import wamrt` stays cheap (no diffusers/transformers import) until the API is used.
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'wamrt' has no attribute {name!r}")
