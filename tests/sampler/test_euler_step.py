"""Euler flow step vs diffusers' FlowMatchEulerDiscreteScheduler."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from wamrt.sampler import denoise, euler_plan, euler_step, framework_flow_schedule


@pytest.mark.parity
@pytest.mark.parametrize("steps", (1, 4, 8))
@pytest.mark.parametrize("v_dtype", (torch.float32, torch.bfloat16))
def test_matches_diffusers(steps: int, v_dtype: torch.dtype) -> None:
    fw = framework_flow_schedule(steps, 5.0)
    ref = FlowMatchEulerDiscreteScheduler(shift=1.0)
    ref.set_timesteps(sigmas=fw.sigmas[:-1].double().numpy())
    assert torch.equal(ref.sigmas, fw.sigmas)
    ref.set_begin_index(0)
    # diffusers on CPU rounds its 0-dim fp32 dt to bf16 inside dt * v: emulate for bit parity.
    plan = euler_plan(fw, model_dtype_scalars=True)
    g = torch.Generator().manual_seed(steps)
    x = torch.randn(2, 3, 16, generator=g)
    x_ref = x.clone()
    for i in range(steps):
        v = torch.randn(x.shape, generator=g).to(v_dtype)
        # diffusers casts its result to v's dtype; we keep fp32, so feed it our state each step.
        x_ref = ref.step(v, ref.timesteps[i], x).prev_sample
        x, _ = euler_step(plan, i, x, v)
        assert x.dtype == torch.float32
        assert torch.equal(x.to(v_dtype), x_ref), i


def test_linear_path_is_exact_in_one_step_per_segment() -> None:
    """On a straight path x = x0 + s * n with v = n, Euler lands on x0 (up to rounding)."""
    g = torch.Generator().manual_seed(1)
    x0, n = torch.randn(256, generator=g), torch.randn(256, generator=g)
    plan = euler_plan(framework_flow_schedule(4, 5.0))
    s0 = plan.schedule.sigmas[0].item()
    out = denoise(plan, x0 + s0 * n, lambda i, _x: n)
    assert (out - x0).abs().max().item() < 1e-6
    assert plan.steps == 4 and all(d < 0 for d in plan.dt)
