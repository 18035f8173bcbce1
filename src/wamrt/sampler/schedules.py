"""Flow-matching sigma/timestep schedules (rectified flow: x_sigma = (1 - sigma) x0 + sigma noise).

Three formulas are kept because they differ in the last bits and the integer timestep the time
embedding sees is a hard parity point:

* ``diffusers``: ``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift).set_timesteps(n)``,
  base linspace(1, 1/T, n+1)[:-1], first shifted sigma nudged below 1 (4 steps, shift 5 ->
  timesteps [999, 937, 833, 625]).
* ``native``: the same scheduler fed ``sigmas=linspace(1 - 1/T, 0, n+1)[:-1]`` (the pipeline's
  ``use_native_flow_schedule``); diffusers still applies ``flow_shift`` to custom sigmas.
* ``framework``: NVIDIA cosmos-framework ``FlowUniPCMultistepScheduler``: base linspace from
  float32(1 - 1/T) (= 0.99900001287 as a float64) to 0 (4 steps, shift 5 -> [999, 937, 833, 624],
  bit-exact against the DROID fixtures). It matches ``native`` in timesteps but can differ from it
  by one float32 ulp in a sigma (the start value differs by 1.3e-9).

All arithmetic is float64 numpy, in the reference order, and cast to float32 once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

ScheduleKind = Literal["diffusers", "native", "framework"]

# diffusers keeps the first flow sigma this far below 1 so that log(1 - sigma) stays finite.
_DIFFUSERS_SIGMA_ONE_EPS = 1e-6


@dataclass(frozen=True, eq=False)
class FlowSchedule:
    """One denoising schedule. ``steps`` model calls walk sigmas[0] -> sigmas[steps] = 0."""

    sigmas: torch.Tensor  # float32 [steps + 1], decreasing, last entry exactly 0
    timesteps: torch.Tensor  # int64 [steps], int(1000 * sigma) as the time embedding sees it

    def __post_init__(self) -> None:
        s, t = self.sigmas, self.timesteps
        if s.dtype != torch.float32 or s.ndim != 1 or s.numel() < 2:
            raise ValueError(f"sigmas must be float32 [steps + 1], got {s.dtype} {tuple(s.shape)}")
        if t.dtype != torch.int64 or t.shape != (s.numel() - 1,):
            raise ValueError(f"timesteps must be int64 [{s.numel() - 1}], got {t.dtype} {tuple(t.shape)}")
        if float(s[-1]) != 0.0:
            raise ValueError("the last sigma must be 0 (final_sigmas_type='zero')")

    @property
    def steps(self) -> int:
        return int(self.timesteps.numel())


def _shift(base: np.ndarray, shift: float) -> np.ndarray:
    # Written as (shift * s) / (1 + (shift - 1) * s): the same association as both references.
    return shift * base / (1 + (shift - 1) * base)


def _finish(shifted: np.ndarray, num_train_timesteps: int) -> FlowSchedule:
    # Timesteps come from the float64 sigmas (truncation, not rounding), before the float32 cast.
    timesteps = torch.from_numpy(shifted * num_train_timesteps).to(torch.int64)
    sigmas = torch.from_numpy(np.concatenate([shifted, [0.0]]).astype(np.float32))
    return FlowSchedule(sigmas=sigmas, timesteps=timesteps)


def schedule_from_sigmas(
    sigmas: Sequence[float] | np.ndarray | torch.Tensor, shift: float = 1.0, num_train_timesteps: int = 1000
) -> FlowSchedule:
    """diffusers' rule for custom sigmas (the ``steps`` values, without the final 0).

    Like ``UniPCMultistepScheduler.set_timesteps(sigmas=...)`` given a float64 array: shift, nudge a
    first sigma within 1e-6 of 1, timesteps int(T * sigma), append 0. Use ``shift=1`` (identity,
    bit for bit) to take sigmas from another scheduler unchanged.
    """
    if isinstance(sigmas, torch.Tensor):
        sigmas = sigmas.detach().cpu().double().numpy()
    base = np.asarray(sigmas, dtype=np.float64).copy()
    if base.ndim != 1 or base.size == 0:
        raise ValueError("sigmas must be a non-empty 1-D sequence (without the final 0)")
    shifted = _shift(base, shift)
    if np.fabs(shifted[0] - 1) < _DIFFUSERS_SIGMA_ONE_EPS:
        shifted[0] -= _DIFFUSERS_SIGMA_ONE_EPS
    return _finish(shifted, num_train_timesteps)


def diffusers_flow_schedule(steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowSchedule:
    """What diffusers' flow UniPC ``set_timesteps(steps)`` produces with ``flow_shift=shift``."""
    _check_steps(steps)
    base = np.linspace(1, 1 / num_train_timesteps, steps + 1)[:-1]
    return schedule_from_sigmas(base, shift, num_train_timesteps)


def native_flow_schedule(steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowSchedule:
    """diffusers fed ``sigmas=linspace(1 - 1/T, 0, steps + 1)[:-1]`` (``use_native_flow_schedule``)."""
    _check_steps(steps)
    base = np.linspace(1 - 1 / num_train_timesteps, 0, steps + 1)[:-1]
    return schedule_from_sigmas(base, shift, num_train_timesteps)


def framework_flow_schedule(steps: int, shift: float, num_train_timesteps: int = 1000) -> FlowSchedule:
    """cosmos-framework ``FlowUniPCMultistepScheduler.set_timesteps(steps, shift=shift)``.

    Its sigma_max is read back from a float32 training table, hence the float32 start value; the
    float32 cast of the final sigmas happens only after the timesteps are taken. No nudge is needed
    because the start is below 1.
    """
    _check_steps(steps)
    sigma_max = float(np.float32(1 - 1 / num_train_timesteps))
    base = np.linspace(sigma_max, 0.0, steps + 1)[:-1]
    return _finish(_shift(base, shift), num_train_timesteps)


def flow_schedule(
    kind: ScheduleKind, steps: int, shift: float, num_train_timesteps: int = 1000
) -> FlowSchedule:
    """Dispatch on the formula name."""
    builders = {
        "diffusers": diffusers_flow_schedule,
        "native": native_flow_schedule,
        "framework": framework_flow_schedule,
    }
    if kind not in builders:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {sorted(builders)}")
    return builders[kind](steps, shift, num_train_timesteps)


def _check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
