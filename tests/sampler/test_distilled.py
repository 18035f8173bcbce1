"""Distilled few-step sampler vs diffusers' FlowMatchEulerDiscreteScheduler as the distilled Cosmos 3
pipeline drives it (custom sigmas, velocity upcast to fp32, generator passed to every step), step for
step and bit for bit, with and without re-noising; plus graph-friendliness checks."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from oracle.host_reads import HostReadRecorder, eager_without_sync_and_captured

from wamrt.sampler import (
    DistilledSchedule,
    denoise,
    distilled_plan,
    distilled_step,
    draw_step_noise,
    make_anchor,
)

# Non-integer timesteps (833.3..., 412.5) and a first sigma of exactly 1 (not nudged, unlike UniPC's).
SCHEDULES = {
    "4step": DistilledSchedule((1.0, 0.8333, 0.4125, 0.2)),
    "4step_shift3": DistilledSchedule((1.0, 0.75, 0.5, 0.25), shift=3.0),
    "2step": DistilledSchedule((0.97, 0.31)),
    "1step": DistilledSchedule((1.0,)),
}
# [1, C, T, H, W] latents; 72 values, not a multiple of 16, so one big [steps, ...] CPU draw would not
# equal the per-step draws (CPU randn fills in blocks of 16) and the step test below would catch it.
SHAPE = (1, 4, 3, 2, 3)


def reference_scheduler(schedule: DistilledSchedule, stochastic: bool) -> FlowMatchEulerDiscreteScheduler:
    ref = FlowMatchEulerDiscreteScheduler(shift=schedule.shift, stochastic_sampling=stochastic)
    ref.set_timesteps(sigmas=[float(s) for s in schedule.sigmas])  # as Cosmos3DistilledSetTimestepsStep does
    return ref


def with_stochastic(schedule: DistilledSchedule, stochastic: bool) -> DistilledSchedule:
    return DistilledSchedule(schedule.sigmas, shift=schedule.shift, stochastic=stochastic)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_plan_matches_diffusers_schedule(name: str) -> None:
    schedule = SCHEDULES[name]
    ref = reference_scheduler(schedule, True)
    plan = distilled_plan(schedule)
    assert torch.equal(plan.sigmas, ref.sigmas)
    assert plan.timesteps == tuple(ref.timesteps.tolist())  # float32 values, compared exactly
    assert plan.steps == len(schedule.sigmas) and plan.coeffs[-1].next_sigma == 0.0
    for c in plan.coeffs:
        assert all(type(getattr(c, f)) is float for f in ("sigma", "next_sigma", "keep", "dt"))
    if schedule.shift == 1.0:
        assert plan.sigmas[:-1].tolist() == torch.tensor(schedule.sigmas, dtype=torch.float32).tolist()


@pytest.mark.parity
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False], ids=["renoise", "euler"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_steps_match_diffusers(name: str, stochastic: bool, v_dtype: torch.dtype) -> None:
    """Same seed on both sides: our pre-drawn noise is the scheduler's in-step draw, step by step."""
    schedule = with_stochastic(SCHEDULES[name], stochastic)
    ref = reference_scheduler(schedule, stochastic)
    plan = distilled_plan(schedule)
    data = torch.Generator().manual_seed(7)
    x = torch.randn(SHAPE, generator=data)
    vs = [torch.randn(SHAPE, generator=data).to(v_dtype) for _ in range(plan.steps)]

    g_ours, g_ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    noise = draw_step_noise(plan, SHAPE, g_ours, "cpu")
    assert (noise is None) == (not stochastic)
    x_ref = x.clone()
    for i, t in enumerate(ref.timesteps):
        # The pipeline upcasts v and steps a [1, *latent] view: the draw shape differs, the values do not.
        x_ref = ref.step(vs[i].float()[None], t, x_ref[None], generator=g_ref, return_dict=False)[0][0]
        x = distilled_step(plan, i, x, vs[i], None if noise is None else noise[i])
        assert x.dtype == torch.float32
        assert torch.equal(x, x_ref), i
    assert torch.equal(g_ours.get_state(), g_ref.get_state())  # same number of draws


def test_step_formulas_and_anchor() -> None:
    """A direct reimplementation of one step (fp32 ops in the reference's order) and the re-anchoring."""
    plan = distilled_plan(SCHEDULES["4step"])
    g = torch.Generator().manual_seed(0)
    x, v, n, ref = (torch.randn(SHAPE, generator=g) for _ in range(4))
    mask = torch.zeros(SHAPE[2], 1, 1)  # the reference's [T, 1, 1] float mask: frame 1 conditioned
    mask[1] = 1.0
    anchor = make_anchor(ref, mask.bool()[None, None])
    for i in range(plan.steps):
        s, s_next = plan.sigmas[i], plan.sigmas[i + 1]  # 0-dim fp32, as the scheduler holds them
        renoised = (1.0 - s_next) * (x - s * v) + s_next * n
        anchored = mask * ref + (1.0 - mask) * renoised
        assert torch.equal(distilled_step(plan, i, x, v, n), renoised)
        assert torch.equal(distilled_step(plan, i, x, v, n, anchor), anchored)
        assert torch.equal(anchored[:, :, 1], ref[:, :, 1])
    euler = distilled_plan(DistilledSchedule(plan.schedule.sigmas, stochastic=False))
    for i in range(euler.steps):
        assert torch.equal(distilled_step(euler, i, x, v), x + (euler.sigmas[i + 1] - euler.sigmas[i]) * v)


def test_exact_velocity_lands_on_the_data() -> None:
    """On x = (1 - s) x0 + s eps with the exact velocity eps - x0, each step predicts x0, re-noises it
    with its own draw (the next eps), and the last step (sigma 0) returns x0."""
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(256, generator=g), torch.randn(256, generator=g)
    plan = distilled_plan(SCHEDULES["4step"])
    noise = draw_step_noise(plan, (256,), torch.Generator().manual_seed(2), "cpu")
    assert noise is not None
    bound = plan.bind(noise)
    s0 = plan.coeffs[0].sigma
    x = (1 - s0) * x0 + s0 * eps
    for i in range(plan.steps):
        x, _ = bound.step(i, x, eps - x0)
        s_next = plan.coeffs[i].next_sigma
        assert (x - ((1 - s_next) * x0 + s_next * noise[i])).abs().max().item() < 1e-5
        eps = noise[i]
    assert (x - x0).abs().max().item() < 1e-5


def test_plan_and_noise_validation() -> None:
    for bad in ((), (1.0, 1.0), (0.5, 0.7), (1.5,), (0.0,), (float("nan"),)):
        with pytest.raises(ValueError):
            DistilledSchedule(bad)
    with pytest.raises(ValueError):
        DistilledSchedule((1.0,), shift=0.0)
    plan = distilled_plan(SCHEDULES["2step"])
    with pytest.raises(ValueError):
        plan.bind(None)  # stochastic without noise
    with pytest.raises(ValueError):
        plan.bind(torch.zeros(3, *SHAPE))  # one row per step
    with pytest.raises(ValueError):
        distilled_step(plan, 0, torch.zeros(SHAPE), torch.zeros(SHAPE))
    euler = distilled_plan(with_stochastic(SCHEDULES["2step"], False))
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    assert draw_step_noise(euler, SHAPE, gen, "cpu") is None
    assert torch.equal(gen.get_state(), before)  # the reference draws nothing without re-noising
    euler.bind(None)


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False], ids=["renoise", "euler"])
def test_loop_reads_nothing_on_host(stochastic: bool, v_dtype: torch.dtype) -> None:
    plan = distilled_plan(with_stochastic(SCHEDULES["4step"], stochastic))
    noise = draw_step_noise(plan, SHAPE, torch.Generator().manual_seed(0), "cpu")  # before the loop
    mask = torch.tensor([True, False, True])[None, None, :, None, None]
    anchor = make_anchor(torch.randn(SHAPE), mask)
    bound = plan.bind(noise, anchor)
    vs = [torch.randn(SHAPE).to(v_dtype) for _ in range(plan.steps)]
    x = torch.randn(SHAPE)
    with HostReadRecorder() as rec:
        out = denoise(bound, x, lambda i, _x: vs[i])
    assert rec.seen == []
    assert torch.equal(out[:, :, 0], anchor.clean[:, :, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_matches_diffusers_on_device(v_dtype: torch.dtype) -> None:
    """Eager (sync debug mode on) == one captured graph of the whole loop == diffusers on CUDA, with
    the noise drawn by a CUDA generator on both sides."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    schedule = SCHEDULES["4step"]
    plan = distilled_plan(schedule)
    shape = (1, 48, 3, 16, 24)
    data = torch.Generator(device=dev).manual_seed(0)
    x_in = torch.randn(shape, device=dev, generator=data)
    w = torch.randn(shape, device=dev, generator=data)
    mask = torch.zeros(1, 1, shape[2], 1, 1, dtype=torch.bool, device=dev)
    mask[:, :, 0] = True
    anchor = make_anchor(x_in, mask)
    noise = draw_step_noise(plan, shape, torch.Generator(device=dev).manual_seed(5), dev)
    bound = plan.bind(noise, anchor)

    def velocity(i: int, x: torch.Tensor) -> torch.Tensor:
        return (w + 0.25 * x).to(v_dtype)  # depends on the state, like a model would

    eager, static_out = eager_without_sync_and_captured(lambda: denoise(bound, x_in, velocity))
    assert torch.equal(static_out, eager)

    ref = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    ref.set_timesteps(sigmas=list(schedule.sigmas), device=dev)
    g_ref = torch.Generator(device=dev).manual_seed(5)
    m = mask[0, 0].float()  # [T, 1, 1]
    x_ref = x_in.clone()
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(velocity(i, x_ref).float()[None], t, x_ref[None], generator=g_ref,
                         return_dict=False)[0][0]
        x_ref = m * x_in + (1.0 - m) * x_ref
    assert torch.equal(x_ref, eager)
