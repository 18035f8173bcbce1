"""World generation with a distilled (few-step) checkpoint, as diffusers 0.42.1's
`Cosmos3DistilledModularPipeline` defines it.

The modes and their conditioning are those of `world.py` (text -> image/video, image -> video,
video -> video; same captions, same initial noise); what changes is the sampling:

* the schedule is fixed by the checkpoint: its `distilled_sigmas` (`modular_model_index.json`) and
  its `FlowMatchEulerDiscreteScheduler` config (`shift`, `stochastic_sampling`), see
  `load_distilled_schedule`;
* guidance is baked into the weights: one conditional Generator pass per step, no negative prompt;
* each step is `sampler.distilled_step`: flow Euler, with fresh seeded noise at every position when the
  scheduler is stochastic; the re-noising draws come from the request's generator right after the
  initial noise, drawn before the loop (`draw_step_noise`), in the reference's order;
* after every step the conditioned latent frames are put back to their clean values.

The distilled pipeline has no sound branch, so `enable_sound=True` is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..model import Cosmos3Transformer, GeneratorTokens
from ..sampler import DistilledPlan, DistilledSchedule, distilled_plan, draw_step_noise, make_anchor
from .denoise import DenoiseInputs, DenoiseResult, _prefill, _sync
from .errors import RequestError
from .inputs import ImageInput, VideoInput
from .omni import decode_pixels, model_device
from .tokens import CaptionTokenizer, as_caption_tokenizer
from .vae import FrameEncoder
from .world import WorldResult, decode_to_frames, world_request

MODULAR_INDEX = "modular_model_index.json"  # holds `distilled_sigmas` in a distilled checkpoint
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
# FlowMatchEulerDiscreteScheduler options that reshape the sigmas when truthy (as the scheduler tests them).
_RESHAPING_SCHEDULER_OPTIONS = (
    "use_dynamic_shifting", "shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
    "invert_sigmas",
)


class DistilledCheckpointError(ValueError):
    """A checkpoint folder whose distilled schedule cannot be read or is not supported."""


def load_distilled_schedule(folder: str | Path) -> DistilledSchedule:
    """The schedule a distilled checkpoint fixes, read as diffusers reads it.

    `distilled_sigmas` from `<folder>/modular_model_index.json`; `shift`, `stochastic_sampling` and
    `num_train_timesteps` from `<folder>/scheduler/scheduler_config.json`, with the scheduler class's
    defaults (1.0, False, 1000) for keys it leaves out. Options that reshape the sigmas (dynamic shift,
    terminal stretch, Karras/exponential/beta sigmas, inversion) are refused.
    """
    folder = Path(folder)
    index_path, sched_path = folder / MODULAR_INDEX, folder / SCHEDULER_CONFIG
    try:
        index = json.loads(index_path.read_text())
        cfg = json.loads(sched_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DistilledCheckpointError(f"{folder}: cannot read {MODULAR_INDEX} and {SCHEDULER_CONFIG}: {e}") from e
    sigmas = index.get("distilled_sigmas")
    if not sigmas:
        raise DistilledCheckpointError(f"{index_path}: no `distilled_sigmas` (not a distilled checkpoint)")
    if cfg.get("_class_name", SCHEDULER_CLASS) != SCHEDULER_CLASS:
        raise DistilledCheckpointError(f"{sched_path}: expected {SCHEDULER_CLASS}, got {cfg['_class_name']}")
    for key in _RESHAPING_SCHEDULER_OPTIONS:
        if cfg.get(key):
            raise DistilledCheckpointError(f"{sched_path}: `{key}={cfg[key]!r}` is not supported")
    try:
        return DistilledSchedule(
            sigmas=tuple(float(s) for s in sigmas),
            shift=float(cfg.get("shift", 1.0)),
            stochastic=bool(cfg.get("stochastic_sampling", False)),
            num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)),
        )
    except (TypeError, ValueError) as e:
        raise DistilledCheckpointError(f"{folder}: {e}") from e


def denoise_distilled(
    model: Cosmos3Transformer,
    inp: DenoiseInputs,
    plan: DistilledPlan,
    noise: torch.Tensor | None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[int, int], None] | None = None,
) -> DenoiseResult:
    """The eager distilled loop: the conditional branch only, one Generator pass and one
    `distilled_step` per step, clean frames re-anchored. `noise`: `draw_step_noise(plan, ...)`.
    `on_step(i, steps)` runs after step i, as in `pipeline.denoise`.

    Vision only (the reference's distilled loop has no sound or action branch). The state stays fp32;
    the transformer sees it in its dtype. Nothing inside the loop reads tensor values on the host.
    """
    if inp.sound is not None or inp.action is not None:
        raise ValueError("the distilled sampler denoises vision only (no sound or action latents)")
    device, dtype = inp.vision.device, model.dtype
    timings: dict[str, float] = {}

    _sync(device)
    t0 = clock()
    kv, rope = _prefill(model, inp.cond)
    _sync(device)
    timings["reasoner_prefill"] = 1e3 * (clock() - t0)

    clean = ~inp.vision_noisy  # [1, T]
    # The reference re-anchors only when some frame is conditioned (a host read before the loop).
    anchor = make_anchor(inp.vision, clean[:, None, :, None, None]) if bool(clean.any()) else None
    bound = plan.bind(noise, anchor)
    x = inp.vision
    for i, t in enumerate(plan.timesteps):
        t_step = clock()
        tok = GeneratorTokens(timesteps=torch.full((1,), t, device=device), vision=x.to(dtype),
                              vision_noisy=inp.vision_noisy)
        v = model.generator_step(tok, rope, kv).vision  # zero on clean frames
        assert v is not None
        x, _ = bound.step(i, x, v)
        _sync(device)
        timings[f"denoise_step{i}"] = 1e3 * (clock() - t_step)
        if on_step is not None:
            on_step(i, plan.steps)
    timings["denoise"] = sum(ms for k, ms in timings.items() if k.startswith("denoise_step"))
    return DenoiseResult(x, None, timings)


@torch.inference_mode()
def run_world_distilled(
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer | Any,
    *,
    prompt: str,
    schedule: DistilledSchedule,
    image: ImageInput | None = None,
    video: VideoInput | None = None,
    condition_latent_frames: Sequence[int] | None = None,
    condition_video_keep: str = "first",
    num_frames: int = 189,
    height: int = 720,
    width: int = 1280,
    fps: float = 24.0,
    enable_sound: bool = False,
    use_system_prompt: bool = True,
    use_resolution_template: bool = True,
    use_duration_template: bool = True,
    generator: torch.Generator | None = None,
    decode: bool = True,
    on_step: Callable[[int, int], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
    denoiser: Callable[..., DenoiseResult] | None = None,
    decoder: Callable[..., torch.Tensor] = decode_pixels,
) -> WorldResult:
    """One world request on a distilled checkpoint (the reference's distilled `pipe(prompt, ...)`).

    The request fields mean what they mean in `run_world`; there is no `negative_prompt`, `steps`,
    `guidance` or `shift` (the checkpoint's `schedule` fixes them), and `enable_sound` must stay False.
    `decode=False` returns latents only. `on_step(i, steps)` and `on_stage(name)` as in `run_world`.
    `denoiser(model, inputs, plan, noise, on_step=)` and `decoder` are where speed comes in from outside
    (`WorldEngine.run_distilled`): `denoise_distilled` and the VAE decode by default.
    """
    t_start = time.perf_counter()
    if not isinstance(schedule, DistilledSchedule):
        raise TypeError(f"schedule must be a DistilledSchedule (see load_distilled_schedule), got {schedule!r}")
    req = world_request(
        prompt=prompt,
        image=image,
        video=video,
        condition_latent_frames=condition_latent_frames,
        condition_video_keep=condition_video_keep,
        num_frames=num_frames,
        height=height,
        width=width,
        fps=fps,
        enable_sound=enable_sound,
        use_system_prompt=use_system_prompt,
        use_resolution_template=use_resolution_template,
        use_duration_template=use_duration_template,
    )
    if req.enable_sound:
        raise RequestError("the distilled pipeline generates no sound", field="enable_sound")
    tokenizer = as_caption_tokenizer(tokenizer)
    device = model_device(model)
    plan = distilled_plan(schedule)
    prepared = req.prepare(model.config, encoder, tokenizer, generator=generator, device=device)
    # The re-noising draws follow the initial noise on the same generator, as in the reference.
    t0 = time.perf_counter()
    noise = draw_step_noise(plan, tuple(prepared.inputs.vision.shape), generator, device)
    draw_ms = 1e3 * (time.perf_counter() - t0)
    if on_stage is not None:
        on_stage("prepared")
    out = (denoiser or denoise_distilled)(model, prepared.inputs, plan, noise, on_step=on_step)
    timings = {**prepared.timings_ms, "step_noise": draw_ms, **out.timings_ms}

    frames = None
    notes: list[str] = []
    if decode:
        if on_stage is not None:
            on_stage("denoised")
        frames = decode_to_frames(decoder, encoder, out.vision, timings, notes)
    timings["total"] = 1e3 * (time.perf_counter() - t_start)
    return WorldResult(out.vision.float(), frames, None, None, timings, notes)
