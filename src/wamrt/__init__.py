"""wamrt: World-Action Model runtime for NVIDIA Cosmos 3 checkpoints.

    import wamrt
    policy = wamrt.load_policy("path/to/checkpoint")      # or "tiny-droid": a built-in, no download
    chunk = policy.infer(observation, steps=4)             # openpi DROID keys -> ActionChunk [32, 8]

load_policy      a checkpoint folder (diffusers, hub, bare transformer, quantized) or a built-in -> Policy
Policy           .infer(observation, seed=..., **SamplingOptions fields) -> ActionChunk; .metadata()
ActionChunk      .actions float32 [32, 8], .seed, .prompt, .timings_ms, .notes
SamplingOptions  steps, guidance, shift, guidance_interval, schedule, solver
RequestError     a refused observation or option; .field names it

The names load lazily: `import wamrt` does not import torch or diffusers until one of them is used.
"""

from typing import Any

from ._version import __version__ as __version__  # re-exported: the one source is _version.py

__all__ = ["ActionChunk", "Policy", "RequestError", "SamplingOptions", "load_policy"]


def __getattr__(name: str) -> Any:
    # Lazy: `import wamrt` stays cheap (no diffusers/transformers import) until the API is used.
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'wamrt' has no attribute {name!r}")


def __dir__() -> list[str]:
    # dir(wamrt), tab completion and help(wamrt) list the lazy names too.
    return sorted({*(n for n in globals() if n.startswith("_")), *__all__})
