"""UniPC (bh2, data prediction, order 2) for flow-matching velocities, as graph-capturable tensor code.

Configuration reproduced (diffusers ``UniPCMultistepScheduler`` and cosmos-framework
``FlowUniPCMultistepScheduler`` alike): ``prediction_type="flow_prediction"``, ``predict_x0``,
``solver_type="bh2"``, ``solver_order=2``, ``lower_order_final``, final sigma 0, UniC corrector from
the second step on, no ``disable_corrector``.

Everything that depends only on the schedule (log-SNR steps, phi functions, the UniC 2x2 solve) is
evaluated once in ``unipc_plan`` with the same float32 scalar operations as diffusers, on the device
the sampler will run on, and stored as Python floats (plus one 0-dim divisor tensor per order-2
step). ``unipc_step`` then issues only elementwise tensor ops whose structure depends on the step
index alone: no ``.item()``, no host sync, no data-dependent branching, so an unrolled loop can be
captured in one CUDA graph.

Notation (flow path x = (1 - s) x0 + s noise): alpha = 1 - s, lambda = log(alpha) - log(s),
h = lambda_next - lambda, e = expm1(-h).  First-order update:
    base = (s_next / s) * x - (alpha_next * e) * x0
Order 2 adds -(alpha_next * e) * 0.5 * D1 with D1 = (x0_prev - x0) / r, r = (lambda_prev - lambda) / h.
The corrector at step i redoes step i-1's update with the new x0:
    x_i = base_{i-1} - alpha_i e_{i-1} (rho0 * D1_{i-1} + rho1 * (x0_i - x0_{i-1})),
where base_{i-1} and D1_{i-1} are exactly the tensors step i-1 already formed (same inputs, same
scalars), so they are carried in the history instead of being recomputed; this is bitwise what
diffusers computes from its ``last_sample`` and ``model_outputs``.

Dtypes: the state ``x`` is float32. ``v`` may be bf16/fp16: the product ``v * sigma`` is formed in
v's dtype and then subtracted from the fp32 ``x`` (fp32 result), like diffusers' ``sample - sigma *
model_output``. Inside that product torch keeps sigma in fp32 when it is a Python number (our case)
and when diffusers runs on CUDA (its sigma is a CPU 0-dim tensor, used as an fp32 kernel scalar);
diffusers on CPU instead casts its 0-dim fp32 sigma to the model dtype first (a tensor on the left
of a reduced-precision ``mul`` is cast to the common dtype). ``model_dtype_scalars=True`` emulates
the CPU behaviour for bitwise parity tests. Everything after x0 is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._common import reduced_variants, scalar_for
from .schedules import FlowSchedule

_SOLVER_ORDER = 2


class UniPCHistory(NamedTuple):
    """Explicit multistep state carried between steps (all None before step 0).

    base: first-order part of the previous update, ratio * x_prev - phi * x0_prev [x.shape, fp32]
    x0:   previous data prediction x_prev - sigma_prev * v_prev                  [x.shape, fp32]
    d1:   previous order-2 difference (x0_prevprev - x0_prev) / r, None after an order-1 step
    """

    base: torch.Tensor | None = None
    x0: torch.Tensor | None = None
    d1: torch.Tensor | None = None


@dataclass(frozen=True)
class UniPCStepCoeffs:
    """Host scalars for step i (all fp32 values held as Python floats)."""

    sigma: float  # sigma_i: x0 = x - v * sigma
    sigma_reduced: tuple[float, float]  # sigma rounded to (bf16, fp16), for model_dtype_scalars
    order: int  # predictor order (1 or 2)
    ratio: float  # sigma_{i+1} / sigma_i
    phi: float  # alpha_{i+1} * expm1(-h_i); equals the bh2 B(h) weight, so it also scales D1
    half_phi: float  # 0.5 * phi (exact): weight of D1 in the order-2 predictor
    corrector: int  # UniC order at this step: 0 (step 0), else the previous predictor's order
    rho0: float  # UniC weight of the previous D1 (order-2 corrector only, else 0)
    rho1: float  # UniC weight of (x0_i - x0_{i-1}); 0.5 for an order-1 corrector
    corr_phi: float  # previous step's phi, which scales the UniC correction
    final: bool  # sigma_{i+1} == 0: ratio 0, phi -1, the update is x0 itself


@dataclass(frozen=True, eq=False)
class UniPCPlan:
    """Per-schedule UniPC constants. Build with ``unipc_plan``; step with ``unipc_step``."""

    schedule: FlowSchedule
    coeffs: tuple[UniPCStepCoeffs, ...]
    # 0-dim fp32 tensors r_i (order-2 steps, else None), created once on the plan device; a tensor
    # rather than a float because CUDA turns division by a host scalar into a reciprocal multiply.
    divisors: tuple[torch.Tensor | None, ...]
    timesteps: tuple[int, ...]  # host copy of schedule.timesteps for the time embedding
    model_dtype_scalars: bool = False

    @property
    def steps(self) -> int:
        return len(self.coeffs)

    def init_history(self) -> UniPCHistory:
        return UniPCHistory()

    def step(
        self, i: int, x: torch.Tensor, v: torch.Tensor, history: UniPCHistory
    ) -> tuple[torch.Tensor, UniPCHistory]:
        return unipc_step(self, i, x, v, history)


def predictor_orders(steps: int) -> list[int]:
    """Orders used per step: warm-up from 1, capped at 2, lower order on the final step."""
    return [min(_SOLVER_ORDER, steps - i, i + 1) for i in range(steps)]


def unipc_plan(
    schedule: FlowSchedule, *, device: torch.device | str | None = None, model_dtype_scalars: bool = False
) -> UniPCPlan:
    """Precompute all UniPC constants of ``schedule``.

    ``device``: where the scalar math runs (defaults to CPU) and where the divisor tensors live. Use
    the sampler's device: CUDA's log/expm1 differ from the CPU's in the last ulp (a CPU-built plan
    on CUDA data drifted 1.4e-6 from a CUDA-built one over 8 steps on an H200), and a CPU divisor
    makes CUDA multiply by a reciprocal instead of dividing. Built on the sampler's device, the
    steps match diffusers on that device bit for bit (checked on CPU and on an H200, fp32 and bf16
    velocities). One host sync here, none in the steps.
    ``model_dtype_scalars``: see the module docstring (CPU diffusers emulation).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    sig = schedule.sigmas.to(device=dev, dtype=torch.float32)  # [n + 1]
    n = schedule.steps
    orders = predictor_orders(n)
    s = [sig[k] for k in range(n + 1)]  # 0-dim fp32 views, mirroring diffusers' per-index scalars
    lam = [torch.log(1 - sk) - torch.log(sk) for sk in s]  # lam[n] = +inf for the final sigma 0
    h = [lam[i + 1] - lam[i] for i in range(n)]
    e = [torch.expm1(-h[i]) for i in range(n)]
    ratio = [s[i + 1] / s[i] for i in range(n)]
    phi = [(1 - s[i + 1]) * e[i] for i in range(n)]
    r = [(lam[i - 1] - lam[i]) / h[i] if orders[i] == 2 else None for i in range(n)]

    rho: list[torch.Tensor | None] = [None] * n  # UniC (rho0, rho1) for an order-2 corrector at i
    for i in range(1, n):
        if orders[i - 1] == 2:
            rho[i] = _unic_weights(h[i - 1], e[i - 1], r[i - 1])

    # One transfer for every scalar: [ratio, phi, rho0, rho1] per step (NaN where unused).
    nan = torch.full((), float("nan"), device=dev)
    rows = [
        torch.stack([ratio[i], phi[i], *(rho[i] if rho[i] is not None else (nan, nan))]) for i in range(n)
    ]
    host = torch.stack(rows).cpu().tolist()
    sig_host = schedule.sigmas.tolist()

    coeffs = []
    for i in range(n):
        c_ratio, c_phi, c_rho0, c_rho1 = host[i]
        corrector = orders[i - 1] if i > 0 else 0
        final = sig_host[i + 1] == 0.0
        if final and (c_ratio != 0.0 or c_phi != -1.0 or orders[i] != 1):
            raise AssertionError("final step must reduce to x0 (ratio 0, phi -1, order 1)")
        coeffs.append(
            UniPCStepCoeffs(
                sigma=sig_host[i],
                sigma_reduced=reduced_variants(sig_host[i]),
                order=orders[i],
                ratio=c_ratio,
                phi=c_phi,
                half_phi=0.5 * c_phi,
                corrector=corrector,
                rho0=c_rho0 if corrector == 2 else 0.0,
                rho1=c_rho1 if corrector == 2 else 0.5,
                corr_phi=host[i - 1][1] if i > 0 else 0.0,
                final=final,
            )
        )
        _check_finite(i, coeffs[-1])
    divisors = tuple(ri.clone() if ri is not None else None for ri in r)
    return UniPCPlan(
        schedule=schedule,
        coeffs=tuple(coeffs),
        divisors=divisors,
        timesteps=tuple(int(t) for t in schedule.timesteps.tolist()),
        model_dtype_scalars=model_dtype_scalars,
    )


def _unic_weights(h: torch.Tensor, e: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Order-2 UniC weights [rho0, rho1]: solve [[1, 1], [r, 1]] rho = [b1, b2] in fp32.

    b_k = k! * phi_{k+1}(-h) scaled by 1/B(h) with B(h) = expm1(-h) (bh2); the phi recursion and
    the LAPACK/cuSOLVER solve are run as diffusers runs them so the weights agree to the bit.
    """
    hh = -h
    g1 = e / hh - 1  # phi_2-type term
    b1 = g1 * 1 / e
    g2 = g1 / hh - 0.5
    b2 = g2 * 2 / e
    one = torch.ones((), dtype=h.dtype, device=h.device)
    lhs = torch.stack([torch.stack([one, one]), torch.stack([r, one])])
    return torch.linalg.solve(lhs, torch.stack([b1, b2]))


def _check_finite(i: int, c: UniPCStepCoeffs) -> None:
    used = [c.sigma, c.ratio, c.phi, c.rho0, c.rho1, c.corr_phi]
    if not all(abs(x) < float("inf") for x in used):  # also rejects NaN
        raise ValueError(f"non-finite UniPC coefficient at step {i} (a sigma of 1 or 0 before the end?): {c}")


def unipc_step(
    plan: UniPCPlan, i: int, x: torch.Tensor, v: torch.Tensor, history: UniPCHistory
) -> tuple[torch.Tensor, UniPCHistory]:
    """One UniPC step: returns (x at sigma_{i+1}, new history).

    x: fp32 state at sigma_i, any shape. v: velocity (model output) at (x, sigma_i), same shape, fp32
    or bf16/fp16. history: ``plan.init_history()`` at i = 0, then what the previous step returned.
    Inputs are not modified; outputs may alias history tensors (the final step returns x0 itself).
    """
    c = plan.coeffs[i]
    sigma = scalar_for(c.sigma, c.sigma_reduced, v.dtype, plan.model_dtype_scalars)
    x0 = x - v * sigma  # product in v's dtype, difference in fp32

    if c.final:
        # ratio 0 and phi -1: x*0 - x0*(-1) is x0 exactly (up to the sign of a zero), so neither the
        # corrector nor the update can change the result.
        return x0, UniPCHistory(base=x0, x0=x0, d1=None)

    if c.corrector:
        if history.x0 is None or history.base is None:
            raise ValueError(f"step {i} needs the history returned by step {i - 1}")
        dx0 = x0 - history.x0
        if c.corrector == 2:
            mix = history.d1 * c.rho0 + dx0 * c.rho1
            x = history.base - mix * c.corr_phi
        else:
            x = history.base - dx0 * (c.rho1 * c.corr_phi)  # rho1 = 0.5 folds exactly into the weight

    base = x * c.ratio - x0 * c.phi
    if c.order == 2:
        d1 = (history.x0 - x0) / plan.divisors[i]
        return base - d1 * c.half_phi, UniPCHistory(base=base, x0=x0, d1=d1)
    return base, UniPCHistory(base=base, x0=x0, d1=None)
