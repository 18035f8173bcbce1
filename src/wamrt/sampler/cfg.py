"""Classifier-free guidance and the guidance interval."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """``uncond + guidance * (cond - uncond)`` with one rounding per op, in the inputs' dtype.

    Deliberately not lerp/addcmul: the framework rounds after the difference, the scaling and the
    sum (bf16 on the real server, fp32 in diffusers); callers choose the dtype by casting first.
    """
    if cond.dtype != uncond.dtype:
        raise ValueError(f"cond and uncond must share a dtype, got {cond.dtype} and {uncond.dtype}")
    if isinstance(guidance, torch.Tensor):
        raise TypeError("guidance must be a Python number (a tensor would cost a host sync or a cast)")
    return uncond + (cond - uncond) * guidance


def guidance_active(
    timesteps: Sequence[int] | torch.Tensor, interval: tuple[float, float] | Sequence[float] | None
) -> list[bool]:
    """Per step: run the uncond pass and CFG? Only where lo < t < hi (strict, integer timestep).

    The framework docs call the interval inclusive but its code is strict, e.g. (960, 1001) enables
    CFG at t = 999 only. ``None`` means every step.
    """
    ts = timesteps.tolist() if isinstance(timesteps, torch.Tensor) else list(timesteps)
    if interval is None:
        return [True] * len(ts)
    lo, hi = interval
    return [bool(lo < int(t) < hi) for t in ts]
