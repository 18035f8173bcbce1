"""Pieces shared by the step functions: the plan protocol and host-side scalar rounding."""

from __future__ import annotations

from typing import Any, Protocol

import torch

# Model-output dtypes for which "scalar * v" rounds to the model dtype (see round_scalar).
REDUCED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


class SamplerPlan(Protocol):
    """What ``denoise`` needs: a step count, an empty history and a per-step update."""

    @property
    def steps(self) -> int: ...

    def init_history(self) -> Any: ...

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, history: Any) -> tuple[torch.Tensor, Any]: ...


def round_scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` and widened back to a Python float (exact in fp32).

    Host-only; used at plan-build time so steps never create tensors from Python numbers.
    """
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).to(torch.float32))


def reduced_variants(value: float) -> tuple[float, float]:
    """(bf16-rounded, fp16-rounded) copies of ``value``, in REDUCED_DTYPES order."""
    return round_scalar(value, torch.bfloat16), round_scalar(value, torch.float16)


def scalar_for(
    exact: float, reduced: tuple[float, float], dtype: torch.dtype, model_dtype_scalars: bool
) -> float:
    """The multiplier a step applies to a tensor of ``dtype``: fp32 value, or its reduced copy."""
    if model_dtype_scalars and dtype in REDUCED_DTYPES:
        return reduced[REDUCED_DTYPES.index(dtype)]
    return exact
