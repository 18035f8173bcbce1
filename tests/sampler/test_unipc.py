"""UniPC vs diffusers' UniPCMultistepScheduler.step, step for step, plus graph-friendliness checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle.host_reads import HostReadRecorder, eager_without_sync_and_captured

from wamrt.sampler import (
    UniPCHistory,
    UniPCPlan,
    denoise,
    diffusers_flow_schedule,
    framework_flow_schedule,
    predictor_orders,
    schedule_from_sigmas,
    unipc_plan,
    unipc_step,
)
from wamrt.sampler.schedules import FlowSchedule

STEPS = (1, 2, 3, 4, 8)
SHIFTS = (1.0, 5.0)
SHAPE = (1, 3, 5, 7)  # diffusers' einsum needs a batch dim and a channel dim


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _compare(
    ref: Any, plan: UniPCPlan, seed: int, v_dtype: torch.dtype = torch.float32
) -> tuple[float, bool, list[torch.Tensor]]:
    """Step diffusers and our plan on the same random x and v; return (max diff, bitwise, our states)."""
    assert torch.equal(ref.sigmas, plan.schedule.sigmas), "oracle and plan must share one schedule"
    ref.set_begin_index(0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    x_ref, hist, worst, bitwise, states = x.clone(), plan.init_history(), 0.0, True, []
    for i in range(plan.steps):
        v = (3 * torch.randn(SHAPE, generator=g)).to(v_dtype)
        x_ref = ref.step(v, ref.timesteps[i], x_ref).prev_sample
        x, hist = unipc_step(plan, i, x, v, hist)
        assert x.dtype == torch.float32 and x.shape == SHAPE
        worst, bitwise = max(worst, _max_abs(x, x_ref)), bitwise and torch.equal(x, x_ref)
        states.append(x)
    return worst, bitwise, states


@pytest.mark.parity
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_matches_diffusers_fp32(diffusers_unipc, steps: int, shift: float) -> None:
    ref = diffusers_unipc(shift)
    ref.set_timesteps(steps)
    worst, bitwise, _ = _compare(ref, unipc_plan(diffusers_flow_schedule(steps, shift)), seed=steps)
    assert worst <= 1e-6
    # Same scalar math and op order as diffusers, so on CPU it is bit for bit.
    assert bitwise, worst


@pytest.mark.parity
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_matches_diffusers_custom_framework_sigmas(diffusers_unipc, steps: int, shift: float) -> None:
    fw = framework_flow_schedule(steps, shift)
    ref = diffusers_unipc(1.0)  # flow_shift=1: custom sigmas are taken as given
    ref.set_timesteps(sigmas=fw.sigmas[:-1].double().numpy())
    worst, bitwise, _ = _compare(ref, unipc_plan(fw), seed=100 + steps)
    assert worst <= 1e-6 and bitwise, worst


@pytest.mark.parity
@pytest.mark.parametrize("steps", (2, 4, 8))
def test_bf16_model_output(diffusers_unipc, steps: int) -> None:
    """bf16 v, fp32 state. diffusers on CPU casts its 0-dim fp32 sigma to bf16 inside sigma * v."""
    fw = framework_flow_schedule(steps, 5.0)

    def oracle() -> Any:
        ref = diffusers_unipc(1.0)
        ref.set_timesteps(sigmas=fw.sigmas[:-1].double().numpy())
        return ref

    # Emulating that cast reproduces CPU diffusers to the bit.
    worst, bitwise, _ = _compare(oracle(), unipc_plan(fw, model_dtype_scalars=True), 7, torch.bfloat16)
    assert bitwise, worst
    # The default keeps sigma fp32 inside the bf16 product (diffusers on CUDA, the framework server):
    # close to CPU diffusers, but not equal, which shows the two rules really differ.
    worst, bitwise, _ = _compare(oracle(), unipc_plan(fw), 7, torch.bfloat16)
    assert not bitwise and 0 < worst < 0.05, worst


def test_default_x0_rule_keeps_sigma_fp32() -> None:
    """One step (sigma_1 = 0) returns x0 itself: check x0 = x - bf16(fp32(v) * fp32 sigma)."""
    sched = schedule_from_sigmas([0.6246874])  # bf16 rounds this sigma to 0.625
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(4096, generator=g), torch.randn(4096, generator=g).bfloat16()
    sigma = sched.sigmas[0].item()
    out, _ = unipc_step(unipc_plan(sched), 0, x, v, UniPCHistory())
    assert torch.equal(out, x - (v.float() * sigma).bfloat16().float())
    lowp, _ = unipc_step(unipc_plan(sched, model_dtype_scalars=True), 0, x, v, UniPCHistory())
    assert torch.equal(lowp, x - (v.float() * torch.tensor(sigma).bfloat16().float()).bfloat16().float())
    assert not torch.equal(out, lowp)


@pytest.mark.parametrize("schedule", [framework_flow_schedule(4, 5.0), diffusers_flow_schedule(8, 5.0)])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_zero_velocity_keeps_clean_entries(schedule: FlowSchedule, v_dtype: torch.dtype) -> None:
    """Clean (conditioning) entries get v = 0 and are never re-anchored: UniPC must keep them put."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    out = denoise(unipc_plan(schedule), x, lambda i, _x: torch.zeros_like(x, dtype=v_dtype))
    drift = _max_abs(out, x)
    assert drift <= 1e-6, drift


def test_orders() -> None:
    assert predictor_orders(1) == [1]
    assert predictor_orders(2) == [1, 1]
    assert predictor_orders(4) == [1, 2, 2, 1]
    plan = unipc_plan(framework_flow_schedule(4, 5.0))
    assert [c.order for c in plan.coeffs] == [1, 2, 2, 1]
    assert [c.corrector for c in plan.coeffs] == [0, 1, 2, 2]
    assert [c.final for c in plan.coeffs] == [False, False, False, True]


def test_plan_holds_only_host_scalars_and_tensors_made_once() -> None:
    plan = unipc_plan(framework_flow_schedule(4, 5.0))
    for c in plan.coeffs:
        for name, value in vars(c).items():
            if name == "sigma_reduced":
                assert all(type(f) is float for f in value)
            elif name in ("order", "corrector"):
                assert type(value) is int, name
            elif name == "final":
                assert type(value) is bool
            else:
                assert type(value) is float, (name, type(value))
    for c, d in zip(plan.coeffs, plan.divisors, strict=True):
        assert (d is not None) == (c.order == 2)
        if d is not None:
            assert d.dtype == torch.float32 and d.ndim == 0 and d.device.type == "cpu"
    assert all(type(t) is int for t in plan.timesteps)
    # Stepping leaves the plan untouched: the divisor tensors are the ones made at build time.
    before = [id(d) for d in plan.divisors]
    x = torch.randn(16)
    denoise(plan, x, lambda i, _x: torch.ones(16))
    assert [id(d) for d in plan.divisors] == before


def test_host_read_recorder_catches_item() -> None:
    """Negative control: the shared recorder (oracle.host_reads) must notice a host read."""
    x = torch.randn(4)
    with HostReadRecorder() as rec:
        _ = (x * 2).sum().item()
        _ = bool(x[0] > 0)
    assert "item" in rec.seen and "__bool__" in rec.seen


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_loop_reads_nothing_on_host(v_dtype: torch.dtype) -> None:
    plan = unipc_plan(framework_flow_schedule(4, 5.0))
    vs = [torch.randn(2, 33, 64).to(v_dtype) for _ in range(plan.steps)]
    x = torch.randn(2, 33, 64)
    with HostReadRecorder() as rec:
        denoise(plan, x, lambda i, _x: vs[i])
    assert rec.seen == []


@pytest.mark.gpu
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_no_sync(diffusers_unipc, v_dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    fw = framework_flow_schedule(4, 5.0)
    plan = unipc_plan(fw, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x_in = torch.randn(1, 4096, device=dev, generator=g)
    vs = [torch.randn(1, 4096, device=dev, generator=g).to(v_dtype) for _ in range(plan.steps)]

    def velocity(i: int, x: torch.Tensor) -> torch.Tensor:
        return vs[i] + (0.25 * x).to(v_dtype)  # depends on the state, like a model would

    eager, static_out = eager_without_sync_and_captured(lambda: denoise(plan, x_in, velocity))
    assert torch.equal(static_out, eager)

    # Against diffusers on the same device: there its sigma stays fp32 inside the bf16 product.
    ref = diffusers_unipc(1.0)
    ref.set_timesteps(sigmas=fw.sigmas[:-1].double().numpy(), device=dev)
    ref.set_begin_index(0)
    x_ref = x_in.clone()
    for i in range(plan.steps):
        x_ref = ref.step(velocity(i, x_ref), ref.timesteps[i], x_ref).prev_sample
    assert (x_ref - eager).abs().max().item() <= 1e-6
    assert torch.equal(x_ref, eager)
