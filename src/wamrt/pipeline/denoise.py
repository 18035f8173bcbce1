"""The eager reference denoising loop shared by every task contract.

It is the numerical definition the fast engine must match: per step, one Generator pass per CFG
branch against that branch's Reasoner K/V (computed once per request), velocity masking, CFG, and one
solver step per modality. Nothing in it reads tensor values on the host.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, Unpack

import torch

from ..model import Cosmos3Transformer, GeneratorOutput, GeneratorTokens, ReasonerKV, Rope
from ..sampler import (
    FlowSchedule,
    cfg_combine,
    euler_plan,
    flow_schedule,
    guidance_active,
    unipc_plan,
)
from .errors import RequestError
from .prefix import ActionAnchor, apply_anchor, guided_velocity

ScheduleName = Literal["framework", "diffusers", "native"]
SolverName = Literal["unipc", "euler"]


@dataclass(frozen=True)
class SamplingOptions:
    """How one request is denoised. The defaults are NVIDIA's DROID policy server's recipe; a checkpoint's
    scheduler config may set `shift` (`wamrt.pipeline.layout.scheduler_defaults`), and `Policy.infer(obs,
    steps=..., ...)` replaces any field for one call (`updated`).

    steps: solver steps (model calls per CFG branch), 1..1000.
    guidance: classifier-free guidance scale; 1 runs no unconditional branch.
    shift: flow shift of the sigma schedule, s' = shift * s / (1 + (shift - 1) * s); > 0.
    guidance_interval: (lo, hi): CFG only at steps whose integer timestep t has lo < t < hi; None = every step.
    schedule: the sigma formula ("framework" = NVIDIA's server, bit-exact; "diffusers"; "native"), see
        `wamrt.sampler.schedules`.
    solver: "unipc" (the checkpoints' solver) or "euler".
    cfg_in_model_dtype: combine CFG in the model dtype, as the framework does (diffusers upcasts to fp32 first).
    control_guidance, control_guidance_interval: video transfer's control guidance scale and where it applies.
    """

    steps: int = 4
    guidance: float = 3.0
    shift: float = 5.0
    guidance_interval: tuple[int, int] | None = None  # CFG only where lo < t < hi (strict)
    schedule: ScheduleName = "framework"
    solver: SolverName = "unipc"
    # The framework combines CFG in the model dtype (bf16 on GPU); diffusers upcasts to fp32 first.
    cfg_in_model_dtype: bool = True
    # Video transfer: a third pass with the conditional text and no controls (`DenoiseInputs.nocontrol`) where
    # control guidance != 1, only where lo < t < hi; v_c = v_nc + cg (v_cond - v_nc) before CFG.
    control_guidance: float = 1.0
    control_guidance_interval: tuple[float, float] | None = None

    def make_schedule(self) -> FlowSchedule:
        return flow_schedule(self.schedule, self.steps, self.shift)

    def step_kinds(self, timesteps: list[float]) -> list[tuple[bool, bool]]:
        """Per step: (CFG on, control guidance on)."""
        cfg = guidance_active(timesteps, self.guidance_interval) if self.guidance != 1.0 else [False] * len(timesteps)
        cg = (guidance_active(timesteps, self.control_guidance_interval) if self.control_guidance != 1.0
              else [False] * len(timesteps))
        return list(zip(cfg, cg, strict=True))
    def updated(self, **overrides: Unpack[SamplingOverrides]) -> SamplingOptions:
        """A copy with `overrides` replaced; an unknown name is an UnknownOptionError with "did you mean"."""
        check_option_names(overrides)
        return replace(self, **overrides) if overrides else self


class SamplingOverrides(TypedDict, total=False):
    """Keyword overrides of `SamplingOptions` for one call (`Policy.infer(obs, steps=2, guidance=1.0)`)."""

    steps: int
    guidance: float
    shift: float
    guidance_interval: tuple[int, int] | None
    schedule: ScheduleName
    solver: SolverName
    cfg_in_model_dtype: bool
    control_guidance: float
    control_guidance_interval: tuple[float, float] | None


class UnknownOptionError(RequestError, TypeError):
    """A keyword that is not a sampling option (a TypeError, as Python's own, and a RequestError naming it)."""


def check_option_names(overrides: Mapping[str, Any]) -> None:
    known = [f.name for f in fields(SamplingOptions)]
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownOptionError(f"unknown sampling option {name!r}; {hint}(options: {', '.join(known)})",
                                     field=name)


@dataclass
class Branch:
    """One CFG branch of one request: its text and the positions of [text | generator] tokens."""

    input_ids: torch.Tensor  # [1, U]
    positions: torch.Tensor  # [1, 3, U + G] float32
    # What the positions are a function of (text length, geometry, ...), when the packer knows it: equal layouts,
    # equal positions, so a consumer may cache what it derives from them (the engine's RoPE tables). Read-only.
    layout: tuple | None = None
    # The token ids as a host tuple, when the packer has them: what a cache keys on without reading input_ids back
    # from the device (a read-back waits for every kernel queued before it, the VAE encode's included).
    token_key: tuple[int, ...] | None = None


@dataclass
class DenoiseInputs:
    """Static per-request inputs of the loop (batch of one)."""

    cond: Branch
    uncond: Branch | None
    vision: torch.Tensor  # [1, C, T, H, W] fp32 initial state (clean frames hold their latents)
    vision_noisy: torch.Tensor  # [1, T] bool
    action: torch.Tensor | None = None  # [1, Ta, A] fp32
    action_noisy: torch.Tensor | None = None  # [1, Ta] bool
    domain_ids: torch.Tensor | None = None  # [1]
    raw_action_dim: int | None = None  # velocity columns >= this are zeroed
    sound: torch.Tensor | None = None  # [1, S, Ts] fp32 (world modes with sound)
    sound_noisy: torch.Tensor | None = None  # [1, Ts] bool
    # Action rows put back before and after every step (a request's committed prefix; wamrt.pipeline.prefix)
    action_anchor: ActionAnchor | None = None
    # Video transfer: clean control latents [1, N, C, T, H, W] (vision's grid) and their weights [1, N] (sum 1); the
    # `cond` and `uncond` branches' positions cover them. `nocontrol`: the conditional text without the controls
    # (positions of [text | vision]), for control guidance.
    controls: torch.Tensor | None = None
    control_weights: torch.Tensor | None = None
    nocontrol: Branch | None = None


@dataclass
class DenoiseResult:
    vision: torch.Tensor
    action: torch.Tensor | None
    timings_ms: dict[str, float] = field(default_factory=dict)
    # Filled only when `record=True`: per step, the masked velocities and the states after the step.
    trace: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    sound: torch.Tensor | None = None


def _prefill(model: Cosmos3Transformer, branch: Branch) -> tuple[ReasonerKV, Rope]:
    rope_und, rope_gen = model.rope(branch.positions).split(branch.input_ids.shape[1])
    return model.prefill_reasoner(branch.input_ids, rope_und), rope_gen


def _mask_action_columns(out: GeneratorOutput, raw_dim: int | None) -> GeneratorOutput:
    if out.action is None or raw_dim is None:
        return out
    cols = torch.arange(out.action.shape[-1], device=out.action.device) < raw_dim
    return GeneratorOutput(out.vision, out.sound, torch.where(cols, out.action, torch.zeros_like(out.action)))


def _detached(value: Any) -> Any:
    """A tensor, a GeneratorOutput or None, cut from the autograd graph a guided step built."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, GeneratorOutput):
        return GeneratorOutput(*(_detached(f) for f in (value.vision, value.sound, value.action)))
    return value


def _sync(device: torch.device) -> None:
    # The stream this loop runs on, not the device: a device-wide synchronize fails while another thread of a server
    # captures a CUDA graph (ops.capture_turn), and the timings need only this loop's work done.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def denoise(
    model: Cosmos3Transformer,
    inp: DenoiseInputs,
    opts: SamplingOptions,
    *,
    record: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[int, int], None] | None = None,
) -> DenoiseResult:
    """`on_step(i, steps)` runs after step i has finished (device synchronised): progress reporting, and a
    place to stop (an exception it raises propagates, dropping the loop's tensors) or to yield the device."""
    device, dtype = inp.vision.device, model.dtype
    schedule = opts.make_schedule()
    plan = (unipc_plan(schedule, device=device) if opts.solver == "unipc" else euler_plan(schedule))
    timesteps = schedule.timesteps.tolist()
    kinds = opts.step_kinds(timesteps)
    cfg_steps = [k[0] for k in kinds]
    if any(cfg_steps) and inp.uncond is None:
        raise ValueError("guidance != 1 needs an unconditional branch")
    if any(k[1] for k in kinds) and (inp.nocontrol is None or inp.controls is None):
        raise ValueError("control guidance != 1 needs controls and a branch without them")
    timings: dict[str, float] = {}

    _sync(device)
    t0 = clock()
    kv_c, rope_c = _prefill(model, inp.cond)
    kv_u = rope_u = None
    if any(cfg_steps):
        assert inp.uncond is not None
        kv_u, rope_u = _prefill(model, inp.uncond)
    rope_n = None
    if any(k[1] for k in kinds):  # same text as the conditional branch (same K/V), positions without the controls
        assert inp.nocontrol is not None
        rope_n = model.rope(inp.nocontrol.positions).split(inp.nocontrol.input_ids.shape[1])[1]
    _sync(device)
    timings["reasoner_prefill"] = 1e3 * (clock() - t0)

    x_v, x_a, x_s = inp.vision, inp.action, inp.sound
    steps_action = inp.action is not None and inp.action_noisy is not None and bool(inp.action_noisy.any())
    anchor, sigmas = inp.action_anchor, schedule.sigmas.tolist()
    if anchor is not None and x_a is not None:
        x_a = apply_anchor(x_a, anchor, sigmas[0])
    hist_v = plan.init_history()
    hist_a = plan.init_history()
    hist_s = plan.init_history()  # each modality keeps its own multistep history, as diffusers' copies do
    trace: dict[str, list[torch.Tensor]] = {}
    guided = steps_action and anchor is not None and anchor.guidance is not None
    for i, t in enumerate(timesteps):
        t_step = clock()

        def velocities(x_a: torch.Tensor | None, i: int = i, t: float = t) -> tuple[Any, ...]:
            tok = GeneratorTokens(
                timesteps=torch.full((1,), float(t), device=device),
                vision=x_v.to(dtype), vision_noisy=inp.vision_noisy,
                action=None if x_a is None else x_a.to(dtype), action_noisy=inp.action_noisy,
                domain_ids=inp.domain_ids,
                sound=None if x_s is None else x_s.to(dtype), sound_noisy=inp.sound_noisy,
                controls=inp.controls, control_weights=inp.control_weights,
            )
            cond = _mask_action_columns(model.generator_step(tok, rope_c, kv_c), inp.raw_action_dim)
            if kinds[i][1]:
                assert rope_n is not None
                free = model.generator_step(replace(tok, controls=None, control_weights=None), rope_n, kv_c)
                v_c, v_n = cond.vision, free.vision
                if not opts.cfg_in_model_dtype:
                    v_c, v_n = v_c.float(), v_n.float()
                cond = GeneratorOutput(cfg_combine(v_c, v_n, opts.control_guidance), cond.sound, cond.action)
            if cfg_steps[i]:
                assert kv_u is not None and rope_u is not None
                unc = _mask_action_columns(model.generator_step(tok, rope_u, kv_u), inp.raw_action_dim)
            else:
                unc = None

            def combine(c: torch.Tensor | None, u: torch.Tensor | None) -> torch.Tensor | None:
                if c is None:
                    return None
                if u is None:
                    return c if opts.cfg_in_model_dtype else c.float()
                if not opts.cfg_in_model_dtype:
                    c, u = c.float(), u.float()
                return cfg_combine(c, u, opts.guidance)

            return (cond, unc, combine(cond.vision, None if unc is None else unc.vision),
                    combine(cond.action, None if unc is None else unc.action),
                    combine(cond.sound, None if unc is None else unc.sound))

        if guided:  # RTC: the action velocity corrected through a backward pass (wamrt.pipeline.prefix)
            assert x_a is not None and anchor is not None
            step_outputs: list[tuple[Any, ...]] = []

            def action_velocity(x_in: torch.Tensor) -> torch.Tensor:
                step_outputs.append(velocities(x_in))
                return step_outputs[-1][3]

            assert inp.action_noisy is not None  # the correction must not move the clean state row
            v_a = guided_velocity(action_velocity, x_a, sigmas[i], anchor)
            v_a = torch.where(inp.action_noisy[..., None], v_a, 0.0)
            cond, unc, v_v, _, v_s = (_detached(o) for o in step_outputs[-1])
        else:
            cond, unc, v_v, v_a, v_s = velocities(x_a)
        assert v_v is not None
        x_v, hist_v = plan.step(i, x_v, v_v, hist_v)
        if x_s is not None:
            assert v_s is not None
            x_s, hist_s = plan.step(i, x_s, v_s, hist_s)
        if steps_action:
            assert x_a is not None and v_a is not None
            x_a, hist_a = plan.step(i, x_a, v_a, hist_a)
            if inp.raw_action_dim is not None:
                # Padded columns start at 0 and get velocity 0, so they stay 0; diffusers re-zeroes them
                # anyway, which also normalises signed zeros.
                x_a = torch.where(torch.arange(x_a.shape[-1], device=device) < inp.raw_action_dim, x_a, 0.0)
            if anchor is not None:
                x_a = apply_anchor(x_a, anchor, sigmas[i + 1])
        if record:
            for name, value in (("vision_v", v_v), ("action_v", v_a), ("action_v_cond", cond.action),
                                ("action_v_uncond", None if unc is None else unc.action),
                                ("sound_v", v_s), ("vision", x_v), ("action", x_a), ("sound", x_s)):
                trace.setdefault(name, []).append(None if value is None else value.detach().clone())
        _sync(device)
        timings[f"denoise_step{i}"] = 1e3 * (clock() - t_step)
        if on_step is not None:
            on_step(i, len(timesteps))
    timings["denoise"] = sum(v for k, v in timings.items() if k.startswith("denoise_step"))
    return DenoiseResult(x_v, x_a, timings, trace, x_s)
