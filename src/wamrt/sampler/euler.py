"""First-order flow (Euler) step with the same plan/step/history interface as UniPC.

x_next = x + (sigma_{i+1} - sigma_i) * v. The step size is formed in fp32 from the fp32 sigmas (as
diffusers' ``FlowMatchEulerDiscreteScheduler`` does), the product ``v * dt`` in v's dtype and the sum
in fp32. Unlike diffusers, the result is not cast back to v's dtype: the state stays fp32.
``model_dtype_scalars`` has the same meaning as for UniPC (round dt to v's dtype first, as diffusers
on CPU does for a 0-dim fp32 tensor on the left of a bf16 ``mul``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import reduced_variants, scalar_for
from .schedules import FlowSchedule


@dataclass(frozen=True, eq=False)
class EulerPlan:
    """Per-schedule Euler constants. Build with ``euler_plan``."""

    schedule: FlowSchedule
    dt: tuple[float, ...]  # sigma_{i+1} - sigma_i computed in fp32 (negative)
    dt_reduced: tuple[tuple[float, float], ...]  # dt rounded to (bf16, fp16)
    timesteps: tuple[int, ...]
    model_dtype_scalars: bool = False

    @property
    def steps(self) -> int:
        return len(self.dt)

    def init_history(self) -> None:
        return None

    def step(
        self, i: int, x: torch.Tensor, v: torch.Tensor, history: None = None
    ) -> tuple[torch.Tensor, None]:
        return euler_step(self, i, x, v, history)


def euler_plan(schedule: FlowSchedule, *, model_dtype_scalars: bool = False) -> EulerPlan:
    sig = schedule.sigmas.to(torch.float32)
    dt = (sig[1:] - sig[:-1]).tolist()  # fp32 differences, as 0-dim fp32 tensors would give
    return EulerPlan(
        schedule=schedule,
        dt=tuple(dt),
        dt_reduced=tuple(reduced_variants(d) for d in dt),
        timesteps=tuple(int(t) for t in schedule.timesteps.tolist()),
        model_dtype_scalars=model_dtype_scalars,
    )


def euler_step(
    plan: EulerPlan, i: int, x: torch.Tensor, v: torch.Tensor, history: None = None
) -> tuple[torch.Tensor, None]:
    """x: fp32 state at sigma_i; v: velocity (fp32/bf16/fp16). Returns (x at sigma_{i+1}, None)."""
    dt = scalar_for(plan.dt[i], plan.dt_reduced[i], v.dtype, plan.model_dtype_scalars)
    return x + v * dt, None
