"""The distilled few-step sampler: flow Euler with seeded re-noising, as graph-capturable tensor code.

Reproduces how diffusers 0.42.1's ``Cosmos3DistilledModularPipeline`` drives its
``FlowMatchEulerDiscreteScheduler``: a fixed list of sigmas from the checkpoint (``distilled_sigmas``),
guidance fixed to 1, and per step i (sigma_i -> sigma_{i+1}), with the velocity upcast to fp32 first:

    stochastic (``stochastic_sampling=True``, what distilled checkpoints use):
        x0 = x - sigma_i * v                                   # data prediction
        x' = (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise_i    # fresh Gaussian noise_i, every position
    deterministic:
        x' = x + (sigma_{i+1} - sigma_i) * v

then the conditioned (clean) latent frames are put back, ``x' = m * ref + (1 - m) * x'`` with m = 1 on
clean frames. The final step has sigma_{i+1} = 0, so it lands on x0 (its noise is still drawn, as
diffusers draws it).

Noise: diffusers draws noise_i with ``randn(x.shape, generator)`` inside step i. Nothing else uses
the generator between steps, so the same draws made one after another *before* the loop
(``draw_step_noise``) are the same numbers; the steps then only index a pre-drawn tensor, which keeps
the loop free of RNG state and host syncs (one CUDA graph can hold it).

Schedule: ``set_timesteps(sigmas=...)`` casts the sigmas to float32, applies the scheduler's ``shift``
(1 in the default config, an identity bit for bit) in float32 numpy, takes timesteps = 1000 * sigma in
float32 (not integers: the time embedding sees e.g. 833.3), and appends sigma 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class DistilledSchedule:
    """What a distilled checkpoint fixes: its sigmas (without the final 0) and its scheduler options.

    ``sigmas``: the pipeline's ``distilled_sigmas`` (``modular_model_index.json``), strictly decreasing
    in (0, 1]. ``shift``/``stochastic``: ``FlowMatchEulerDiscreteScheduler``'s ``shift`` and
    ``stochastic_sampling`` config values.
    """

    sigmas: tuple[float, ...]
    shift: float = 1.0
    stochastic: bool = True
    num_train_timesteps: int = 1000

    def __post_init__(self) -> None:
        sig = tuple(float(s) for s in self.sigmas)
        if not sig:
            raise ValueError("a distilled schedule needs at least one sigma")
        if not all(math.isfinite(s) and 0.0 < s <= 1.0 for s in sig):
            raise ValueError(f"distilled sigmas must lie in (0, 1], got {list(sig)}")
        # Repeated timesteps would make diffusers start at the second match (index_for_timestep).
        if any(b >= a for a, b in zip(sig, sig[1:])):
            raise ValueError(f"distilled sigmas must be strictly decreasing, got {list(sig)}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a positive finite number, got {self.shift!r}")
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {self.stochastic!r}")
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, int) or (
                self.num_train_timesteps < 1):
            raise ValueError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        object.__setattr__(self, "sigmas", sig)

    @property
    def steps(self) -> int:
        return len(self.sigmas)


@dataclass(frozen=True)
class DistilledStepCoeffs:
    """Host scalars of step i, each an exact float32 value held as a Python float."""

    sigma: float  # sigma_i: x0 = x - sigma_i * v
    next_sigma: float  # sigma_{i+1}: weight of the fresh noise
    keep: float  # 1 - sigma_{i+1} in float32: weight of x0
    dt: float  # sigma_{i+1} - sigma_i in float32 (deterministic step)


class Anchor(NamedTuple):
    """The clean frames a step puts back: x' = clean + keep * x' (diffusers' m * ref + (1 - m) * x').

    clean: m * ref [x.shape] fp32 (ref on clean frames, zero elsewhere)
    keep:  1 - m, fp32, broadcastable to x (1 on noisy frames, 0 on clean ones)
    """

    clean: torch.Tensor
    keep: torch.Tensor


def make_anchor(reference: torch.Tensor, clean_mask: torch.Tensor) -> Anchor:
    """``reference``: fp32 latents whose clean frames are the conditioning; ``clean_mask``: bool or 0/1,
    broadcastable to it (e.g. [1, 1, T, 1, 1]). Built once per request, before the loop."""
    m = clean_mask.to(device=reference.device, dtype=torch.float32)
    return Anchor(clean=m * reference.float(), keep=1.0 - m)


@dataclass(frozen=True, eq=False)
class DistilledPlan:
    """Per-schedule constants. Build with ``distilled_plan``; step with ``distilled_step``."""

    schedule: DistilledSchedule
    sigmas: torch.Tensor  # float32 [steps + 1] on the CPU, last entry 0 (diffusers' scheduler.sigmas)
    timesteps: tuple[float, ...]  # float32 values of 1000 * sigma_i, what the time embedding sees
    coeffs: tuple[DistilledStepCoeffs, ...]

    @property
    def steps(self) -> int:
        return len(self.coeffs)

    @property
    def stochastic(self) -> bool:
        return self.schedule.stochastic

    def bind(self, noise: torch.Tensor | None = None, anchor: Anchor | None = None) -> BoundDistilledPlan:
        """This plan with one request's pre-drawn noise and anchor: the ``SamplerPlan`` interface."""
        if self.stochastic and (noise is None or noise.shape[0] != self.steps):
            raise ValueError(f"a stochastic plan needs noise with {self.steps} rows (draw_step_noise)")
        return BoundDistilledPlan(self, noise, anchor)


@dataclass(frozen=True, eq=False)
class BoundDistilledPlan:
    """A ``SamplerPlan`` (``steps``/``init_history``/``step``) for ``sampler.denoise`` and the pipelines."""

    plan: DistilledPlan
    noise: torch.Tensor | None  # [steps, *x.shape] fp32, or None for a deterministic plan
    anchor: Anchor | None

    @property
    def steps(self) -> int:
        return self.plan.steps

    def init_history(self) -> None:
        return None

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, history: None = None) -> tuple[torch.Tensor, None]:
        noise = None if self.noise is None else self.noise[i]
        return distilled_step(self.plan, i, x, v, noise, self.anchor), None


def distilled_plan(schedule: DistilledSchedule) -> DistilledPlan:
    """Sigmas, timesteps and step scalars as ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)``
    computes them (float32 numpy for the shift, float32 torch for the rest). Host only."""
    base = np.array(schedule.sigmas).astype(np.float32)
    shift = schedule.shift
    shifted = shift * base / (1 + (shift - 1) * base)  # float32 throughout, the reference's association
    sig = torch.from_numpy(np.ascontiguousarray(shifted)).to(torch.float32)
    timesteps = sig * schedule.num_train_timesteps  # float32, like the reference
    sigmas = torch.cat([sig, torch.zeros(1, dtype=torch.float32)])  # [n + 1]
    if not bool(torch.isfinite(sigmas).all()) or not bool((sigmas[:-1] > 0).all()):
        raise ValueError(f"shift {shift} maps the sigmas outside (0, 1]: {sigmas.tolist()}")

    n = schedule.steps
    keep = (1.0 - sigmas[1:]).tolist()  # 0-dim fp32 arithmetic in the reference: same float32 values
    dt = (sigmas[1:] - sigmas[:-1]).tolist()
    host = sigmas.tolist()
    coeffs = tuple(DistilledStepCoeffs(sigma=host[i], next_sigma=host[i + 1], keep=keep[i], dt=dt[i]) for i in range(n))
    return DistilledPlan(schedule=schedule, sigmas=sigmas, timesteps=tuple(timesteps.tolist()), coeffs=coeffs)


def draw_step_noise(
    plan: DistilledPlan,
    shape: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device | str,
) -> torch.Tensor | None:
    """All re-noising draws of one request, before the loop: fp32 [steps, *shape] on ``device``.

    One ``randn(shape)`` per step, in step order, on the generator's device (like diffusers'
    ``randn_tensor``: a CPU generator draws on the CPU whatever the target device). Call it right
    after the initial noise is drawn, which is where diffusers' first step draw falls. None (and no
    draw) for a deterministic plan, as diffusers draws nothing there.
    """
    if not plan.stochastic:
        return None
    device = torch.device(device)
    where = generator.device if generator is not None else device
    draws = [torch.randn(tuple(shape), generator=generator, device=where, dtype=torch.float32)
             for _ in range(plan.steps)]
    return torch.stack(draws).to(device)


def distilled_step(
    plan: DistilledPlan,
    i: int,
    x: torch.Tensor,
    v: torch.Tensor,
    noise: torch.Tensor | None = None,
    anchor: Anchor | None = None,
) -> torch.Tensor:
    """One step: returns the fp32 state at sigma_{i+1}.

    x: fp32 state at sigma_i. v: velocity at (x, sigma_i), any float dtype (upcast to fp32 first, as
    the reference does before its scheduler step). noise: step i's draw, x.shape, fp32 (stochastic
    plans only). anchor: the request's clean frames, or None when nothing is conditioned.
    Elementwise ops with Python-float scalars only: no host reads, no RNG, no data-dependent branches.
    """
    c = plan.coeffs[i]
    v = v.float()
    if plan.stochastic:
        if noise is None:
            raise ValueError(f"step {i} of a stochastic plan needs its noise draw")
        x0 = x - v * c.sigma
        out = x0 * c.keep + noise * c.next_sigma
    else:
        out = x + v * c.dt
    if anchor is not None:
        out = anchor.clean + anchor.keep * out
    return out
