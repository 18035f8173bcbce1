"""Several GPUs of one host behind one engine: CFG-parallel (one guidance branch per GPU) and tensor
parallel (every layer split across GPUs). Distributed code lives here, outside the model."""

from .launch import MODES, ParallelPolicy, ParallelSpec, start

__all__ = ["MODES", "ParallelPolicy", "ParallelSpec", "start"]
