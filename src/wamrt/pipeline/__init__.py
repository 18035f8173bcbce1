"""Task contracts: observations -> model inputs -> eager reference loop -> action chunks."""

from .denoise import SamplingOptions, denoise
from .droid import ActionChunk, DroidContract, run_droid
from .errors import RequestError
from .policy import Policy, load_policy

__all__ = [
    "ActionChunk",
    "DroidContract",
    "Policy",
    "RequestError",
    "SamplingOptions",
    "denoise",
    "load_policy",
    "run_droid",
]
