"""The denoising loop: one plan, a velocity callback, Python control flow on the step index only."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._common import SamplerPlan

Velocity = Callable[[int, torch.Tensor], torch.Tensor]  # (step index i, state x at sigma_i) -> v


def denoise(
    plan: SamplerPlan, x: torch.Tensor, velocity: Velocity, trajectory: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Run all ``plan.steps`` steps from ``x`` (fp32, at sigma_0) and return the state at sigma = 0.

    Nothing here reads tensor values on the host, so with a capturable ``velocity`` the whole call
    can be recorded as one CUDA graph. ``trajectory``, if given, receives the state after each step.
    """
    history = plan.init_history()
    for i in range(plan.steps):
        x, history = plan.step(i, x, velocity(i, x), history)
        if trajectory is not None:
            trajectory.append(x)
    return x
