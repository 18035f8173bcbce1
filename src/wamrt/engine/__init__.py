"""The fast path: fused weights, Reasoner K/V cache, batched CFG, compiled layers, CUDA graphs."""

from .config import EngineConfig
from .engine import Engine, ReasonerCache
from .fuse import fuse_generator

__all__ = ["Engine", "EngineConfig", "ReasonerCache", "fuse_generator"]
