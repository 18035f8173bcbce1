"""World-generation jobs (text/image/video -> video, optionally with sound; text -> image) for `/v1/videos`,
`/v1/videos/sync` and `/v1/images/generations`, with vLLM-Omni's request fields.

Sampler. A checkpoint runs `wamrt.pipeline.world.run_world` (UniPC with CFG), or, when it is a distilled one,
`wamrt.pipeline.world_distilled.run_world_distilled` (its own few-step schedule, guidance baked in). Which one
is decided once, at startup, by `generation_settings.resolve_sampler` (`wamrt serve --sampler`, default: from
the checkpoint folder) and held by `WorldModel.schedule`; `build_generation` reads the request fields for that
sampler.

Scheduling. Generation runs on its own thread (`GenerationWorker`, one job at a time, its own bounded
queue of `max_generation_jobs`), and shares the device with the policy queue through the batcher's
`DeviceGate`: it holds the device for one segment at a time (prefill plus the first denoising step, each
further step, each latent frame of the VAE decode, the sound decode) and between segments (the pipelines'
`on_step`, the decoder's per-frame hook) it gives the device up for as long as any policy request is queued or
running. On CUDA servers the `WorldEngine` splits every step further into `--generation-step-segments` graphs of
consecutive layers and yields between them too (`on_segment`), so a 480p step of ~190 ms is ~16 ms segments.
So a policy request waits at most one generation segment, and a video job never takes a slot of the policy
queue. The same `on_step` reports progress and stops a cancelled job (DELETE, or its /sync client left)
between steps; the job's tensors go with the unwound stack.

Field parsing (`build_generation`) decodes uploads and validates everything the pipeline would refuse before
a job exists, naming the field as the client sent it; call it off the event loop.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..pipeline.errors import RequestError
from .batcher import DeviceGate, GenerationCancelled
from .dynamics import _conditioning
from .errors import Busy, Cancelled, InvalidRequest, NotReady, ServingError, as_serving_error
from .fields import as_float, as_int
from .generation_settings import resolve_sampler
from .media import audio_rate, encode_mp4, encode_png

if TYPE_CHECKING:
    from ..sampler import DistilledSchedule

log = logging.getLogger("wamrt.serving")

Kind = Literal["video", "image"]
Sampler = Literal["unipc", "distilled"]
# Defaults: vLLM-Omni's Cosmos3 recipe (T2V/I2V/V2V 1280x720, 189 frames at 24 fps, 35 steps, guidance 6,
# flow shift 10; T2I 1024x1024, 50 steps, guidance 7); the metadata sentences are off unless asked for,
# as in vLLM-Omni's server (run_world's own defaults are diffusers', where they are on).
VIDEO_DEFAULTS = {"width": 1280, "height": 720, "num_frames": 189, "fps": 24.0, "steps": 35, "guidance": 6.0,
                  "shift": 10.0}
IMAGE_DEFAULTS = {"width": 1024, "height": 1024, "num_frames": 1, "fps": 24.0, "steps": 50, "guidance": 7.0,
                  "shift": 10.0}
MAX_IMAGES = 10  # `n` of /v1/images/generations (vLLM-Omni: 1-10)
MAX_FRAMES = 1025
# extra_params keys a generation request may carry (vLLM-Omni `extra_args` that this runtime implements).
EXTRA_KEYS = ("use_resolution_template", "use_duration_template", "use_system_prompt",
              "condition_frame_indexes_vision", "condition_video_keep", "guardrails", "flow_shift",
              "max_sequence_length", "video")
# vLLM-Omni request fields for features this runtime does not have: refused, never silently dropped.
UNSUPPORTED = ("guidance_scale_2", "true_cfg_scale", "boundary_ratio", "control_reference", "control_type",
               "audio_reference", "lora", "enable_frame_interpolation", "frame_interpolation_exp",
               "frame_interpolation_scale", "frame_interpolation_model_path", "aspect_ratio", "short_edge",
               "start_time_seconds")
# AutoencoderKLWan's per-call conv caches (diffusers 0.42.1 `clear_cache`): decoder, then encoder.
_WAN_DECODE_STATE = ("_conv_num", "_conv_idx", "_feat_map", "_enc_conv_num", "_enc_conv_idx", "_enc_feat_map")
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


# ------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True, eq=False)
class WorldModel:
    """What generation needs from the served checkpoint: transformer, VAE (encoder + decoder), caption
    tokenizer, the sound tokenizer when the transformer has sound heads and the checkpoint ships one, and the
    distilled schedule when the checkpoint is served with the distilled sampler (`resolve_sampler`)."""

    model: Any
    encoder: Any
    tokenizer: Any
    sound: Any | None  # pipeline.sound.SoundDecoder
    schedule: DistilledSchedule | None = None  # None: UniPC with CFG (`run_world`)
    engine: Any | None = None  # a `WorldEngine` (served fast engine on CUDA), else None: the eager pipelines

    def run(self, *, on_segment: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """One request with the served sampler (`run_world`, or `run_world_distilled` with the checkpoint's
        schedule), through the engine when there is one; `on_segment` runs inside every step where the engine
        splits it (`WorldEngine.step_segments`; the eager pipelines have no such points)."""
        if self.schedule is not None:
            if self.engine is not None:
                return self.engine.run_distilled(schedule=self.schedule, on_segment=on_segment, **kwargs)
            from ..pipeline.world_distilled import run_world_distilled

            return run_world_distilled(self.model, self.encoder, self.tokenizer, schedule=self.schedule, **kwargs)
        if self.engine is not None:
            return self.engine.run(on_segment=on_segment, **kwargs)
        from ..pipeline.world import run_world

        return run_world(self.model, self.encoder, self.tokenizer, **kwargs)

    @property
    def sound_heads(self) -> bool:
        return bool(getattr(self.model.config, "sound_gen", False))

    @property
    def sampler(self) -> Sampler:
        return "unipc" if self.schedule is None else "distilled"


def find_sound_tokenizer(checkpoint: str) -> Path | None:
    """`sound_tokenizer/` of a checkpoint folder (or of the folder above a bare transformer folder), or of a
    built-in model; None if there is none."""
    from ..pipeline.builtin import BUILTIN_MODELS, builtin_path

    if not checkpoint or checkpoint.startswith("random:") or (
            not Path(checkpoint).exists() and checkpoint not in BUILTIN_MODELS):
        return None
    root = builtin_path(checkpoint) if checkpoint in BUILTIN_MODELS else Path(checkpoint)
    for folder in (root / "sound_tokenizer", root.parent / "sound_tokenizer"):
        if (folder / "config.json").is_file():
            return folder
    return None


def world_model_of(policy: Any, checkpoint: str, sampler: str = "auto", *,
                   step_segments: int = 1) -> WorldModel | None:
    """The served policy's (or fast engine's) model/encoder/tokenizer as a `WorldModel`; None when it has none
    (a stand-in policy, a multi-GPU front end). The sound tokenizer is loaded only for a transformer with
    sound heads, from the loaded checkpoint (`policy.name`) or else the served one (`checkpoint`); the sampler
    is `resolve_sampler(sampler, checkpoint)`; `step_segments` is the `WorldEngine`'s (capped at the layers)."""
    if not all(hasattr(policy, a) for a in ("model", "encoder", "tokenizer")):
        return None
    schedule = resolve_sampler(sampler, checkpoint)
    sound = None
    if getattr(policy.model.config, "sound_gen", False):
        names = dict.fromkeys(n for n in (str(getattr(policy, "name", "") or ""), checkpoint) if n)
        folder = next((f for f in map(find_sound_tokenizer, names) if f is not None), None)
        if folder is not None:
            from ..pipeline.omni import model_device
            from ..pipeline.sound import SoundDecoder, load_sound_tokenizer

            sound = SoundDecoder(load_sound_tokenizer(folder, device=model_device(policy.model)))
    return WorldModel(policy.model, policy.encoder, policy.tokenizer, sound, schedule,
                      _world_engine(policy, step_segments))


def _world_engine(policy: Any, step_segments: int = 1) -> Any | None:
    """A `WorldEngine` sharing the served fast engine's model, VAE and tokenizer (its own compiled wrappers, graph
    pool and K/V arena; one of them runs at a time, see `DeviceGate`), when that engine runs CUDA graphs; else
    None (CPU servers and the eager reference policy keep `run_world`)."""
    from ..engine import Engine
    from ..engine.world import WORLD_ENGINE_CONFIG, WorldEngine

    # On the device type too: CPU tests run the policy engine's graph path with a stand-in for CUDA graphs, and a
    # WorldEngine with graphs refuses a CPU model.
    if not isinstance(policy, Engine) or not policy.config.cuda_graph or policy.device.type != "cuda":
        return None
    config = replace(WORLD_ENGINE_CONFIG, attention=policy.config.attention, compile_mode=policy.config.compile_mode)
    return WorldEngine(policy.model, policy.encoder, policy.tokenizer, config, name=policy.name,
                       step_segments=min(step_segments, len(policy.model.layers)))


# ------------------------------------------------------------------------------------------------
# Requests

@dataclass
class GenerationRequest:
    """One validated generation request: keyword arguments of the served sampler's pipeline (`run_world`, or
    `run_world_distilled` without its `schedule`; no model, no generator) and what the reply says about it."""

    kind: Kind
    kwargs: dict[str, Any]
    seed: int | None
    count: int  # images to generate (`n`); 1 for a video
    sound: bool
    record: dict[str, Any]  # model, prompt, size, seconds for the job record
    sampling: dict[str, Any]  # sampler, steps, guidance, shift: what runs, for the reply's metadata
    notes: list[str] = field(default_factory=list)

    @property
    def fps(self) -> float:
        return float(self.kwargs["fps"])

    @property
    def steps(self) -> int:
        return int(self.sampling["steps"])


def _present(value: Any) -> bool:
    return value not in (None, "", b"")


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise InvalidRequest(f"must be a boolean (true / false), got {value!r}", field=name)


def _spatial(value: Any, name: str) -> int:
    size = as_int(value, name, 16, 8192)
    if size % 16:
        raise InvalidRequest(f"must be a multiple of 16 (the VAE's spatial factor), got {size}", field=name)
    return size


def _size(fields: dict[str, Any], defaults: dict[str, Any]) -> tuple[int, int, str]:
    """(width, height, field name the size came from)."""
    if _present(fields.get("size")) and fields["size"] != "auto":  # "auto" (OpenAI): the default size
        m = _SIZE.match(str(fields["size"]))
        if not m:
            raise InvalidRequest(f"must be WIDTHxHEIGHT, e.g. 1280x720, got {fields['size']!r}", field="size")
        w, h = int(m.group(1)), int(m.group(2))
        for v in (w, h):
            if not 16 <= v <= 8192 or v % 16:
                raise InvalidRequest(f"width and height must be multiples of 16 (the VAE's spatial factor) in "
                                     f"[16, 8192], got {w}x{h}", field="size")
        return w, h, "size"
    w = _spatial(fields["width"], "width") if _present(fields.get("width")) else defaults["width"]
    h = _spatial(fields["height"], "height") if _present(fields.get("height")) else defaults["height"]
    return w, h, "width" if _present(fields.get("width")) else "height" if _present(fields.get("height")) else "size"


def _num_frames(fields: dict[str, Any], fps: float, default: int) -> int:
    if _present(fields.get("num_frames")):
        n = as_int(fields["num_frames"], "num_frames", 1, MAX_FRAMES)
    elif _present(fields.get("seconds")):
        seconds = as_float(fields["seconds"], "seconds")
        if seconds <= 0:
            raise InvalidRequest(f"must be > 0, got {fields['seconds']!r}", field="seconds")
        n = 4 * max(1, round(seconds * fps / 4)) + 1  # the nearest clip length the VAE can represent
        if n > MAX_FRAMES:
            raise InvalidRequest(f"{seconds} s at {fps:g} fps is more than {MAX_FRAMES} frames", field="seconds")
    else:
        return default
    if (n - 1) % 4:
        raise InvalidRequest(f"must be 4k + 1 (1, 5, 9, ..., the frame counts the VAE keeps), got {n}",
                             field="num_frames")
    return n


def _extra(fields: dict[str, Any]) -> dict[str, Any]:
    extra = fields.get("extra_params") or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise InvalidRequest(f"is not valid JSON ({exc})", field="extra_params") from exc
    if not isinstance(extra, dict):
        raise InvalidRequest("must be a JSON object", field="extra_params")
    for key in extra:
        if key not in EXTRA_KEYS:
            raise InvalidRequest(f"is not a world-generation option of this runtime (known: {', '.join(EXTRA_KEYS)})",
                                 field=f"extra_params.{key}")
    return extra


# RequestError fields of `world_request` -> the request field the client sent.
def _field_map(source: str, size_field: str) -> dict[str, str]:
    return {"prompt": "prompt", "negative_prompt": "negative_prompt", "num_frames": "num_frames",
            "height": size_field, "width": size_field, "fps": "fps", "image": source, "video": source,
            "condition_latent_frames": "extra_params.condition_frame_indexes_vision",
            "condition_video_keep": "extra_params.condition_video_keep", "enable_sound": "generate_sound",
            "sound_decoder": "generate_sound", "use_system_prompt": "extra_params.use_system_prompt",
            "use_resolution_template": "extra_params.use_resolution_template",
            "use_duration_template": "extra_params.use_duration_template"}


def _sampling(fields: dict[str, Any], extra: dict[str, Any], defaults: dict[str, Any],
              schedule: DistilledSchedule | None, notes: list[str]) -> dict[str, Any]:
    """`num_inference_steps`, `guidance_scale` and `flow_shift` (or `extra_params.flow_shift`) -> the sampler
    settings the job runs with: {sampler, steps, guidance, shift}."""
    steps = as_int(fields["num_inference_steps"], "num_inference_steps", 1, 1000) \
        if _present(fields.get("num_inference_steps")) else None
    guidance = as_float(fields["guidance_scale"], "guidance_scale") if _present(fields.get("guidance_scale")) else None
    if guidance is not None and guidance < 0:
        raise InvalidRequest(f"must be >= 0, got {guidance}", field="guidance_scale")
    shift_src = "flow_shift" if _present(fields.get("flow_shift")) else "extra_params.flow_shift"
    shift_val = fields.get("flow_shift") if _present(fields.get("flow_shift")) else extra.get("flow_shift")
    shift = as_float(shift_val, shift_src) if _present(shift_val) else None
    if shift is not None and shift <= 0:
        raise InvalidRequest(f"must be > 0, got {shift}", field=shift_src)
    if schedule is None:
        return {"sampler": "unipc", "steps": defaults["steps"] if steps is None else steps,
                "guidance": defaults["guidance"] if guidance is None else guidance,
                "shift": defaults["shift"] if shift is None else shift}
    # A distilled checkpoint fixes all three. Another step count would be another sampler, so it is refused (as
    # diffusers' distilled pipeline refuses it); guidance and shift are ignored with a note, as vLLM-Omni forces
    # guidance 1 and the checkpoint's sigmas on a distilled Cosmos 3 checkpoint, so requests written for a base
    # checkpoint still run.
    if steps is not None and steps != schedule.steps:
        raise InvalidRequest(f"the served checkpoint is distilled to {schedule.steps} steps (its schedule fixes "
                             f"them): send {schedule.steps} or leave it out, got {steps}", field="num_inference_steps")
    if guidance is not None and guidance != 1.0:
        notes.append(f"guidance_scale {guidance:g} ignored: the distilled checkpoint has guidance baked in (runs at 1)")
    if shift is not None and shift != schedule.shift:
        notes.append(f"{shift_src} {shift:g} ignored: the distilled checkpoint's schedule fixes its sigmas "
                     f"(shift {schedule.shift:g})")
    return {"sampler": "distilled", "steps": schedule.steps, "guidance": 1.0, "shift": schedule.shift}


def build_generation(fields: dict[str, Any], world: WorldModel | None, *, kind: Kind = "video",
                     max_pixels: int, model_name: str = "") -> GenerationRequest:
    """Form/JSON fields of a generation request -> a validated `GenerationRequest`, or `InvalidRequest` naming
    the field. CPU work (decoding uploads, PIL conversion): call it off the event loop."""
    from ..pipeline.world import world_request

    if world is None:
        raise InvalidRequest(f"the served model ({model_name or 'this engine'}) has no world-generation path "
                             "(it needs a transformer, a VAE and a caption tokenizer)", field="model")
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("is required", field="prompt")
    negative = fields.get("negative_prompt")
    if _present(negative) and not isinstance(negative, str):
        raise InvalidRequest("must be a string", field="negative_prompt")
    for name in UNSUPPORTED:
        if _present(fields.get(name)):
            raise InvalidRequest("is not supported by this runtime", field=name)
    extra = _extra(fields) if kind == "video" else {}
    notes: list[str] = []
    defaults = VIDEO_DEFAULTS if kind == "video" else IMAGE_DEFAULTS

    fps = as_float(fields["fps"], "fps") if _present(fields.get("fps")) else defaults["fps"]
    if not 0 < fps <= 240:
        raise InvalidRequest(f"must be in (0, 240], got {fps}", field="fps")
    width, height, size_field = _size(fields, defaults)
    num_frames = _num_frames(fields, fps, defaults["num_frames"]) if kind == "video" else 1
    count = as_int(fields["n"], "n", 1, MAX_IMAGES) if kind == "image" and _present(fields.get("n")) else 1
    if kind == "image" and fields.get("response_format") not in (None, "", "b64_json"):
        raise InvalidRequest("only b64_json is served (no URLs)", field="response_format")

    # Job size: pixels the VAE decodes (and, per latent, what the transformer attends over) bound memory and time.
    pixels = width * height * num_frames * count
    if pixels > max_pixels:
        name = size_field if width * height > max_pixels else "n" if count > 1 else "num_frames"
        raise InvalidRequest(f"{width}x{height} x {num_frames} frames{f' x {count} images' if count > 1 else ''} = "
                             f"{pixels} pixels is over this server's {max_pixels} (--max-video-pixels)", field=name)

    sampling = _sampling(fields, extra, defaults, world.schedule, notes)
    if world.schedule is not None and _present(negative):
        notes.append("negative_prompt ignored: a distilled checkpoint runs no unconditional branch")
        negative = None
    seed = as_int(fields["seed"], "seed", 0, 2**63 - 1) if _present(fields.get("seed")) else None
    for key in ("max_sequence_length",):
        for src, value in ((key, fields.get(key)), (f"extra_params.{key}", extra.get(key))):
            if _present(value):
                as_int(value, src, 1, 1 << 20)
                notes.append(f"{key} accepted; captions are never truncated here")

    sound = _bool(fields["generate_sound"], "generate_sound") if _present(fields.get("generate_sound")) else False
    if sound and kind == "image":
        raise InvalidRequest("an image has no sound", field="generate_sound")
    if sound and world.schedule is not None:
        raise InvalidRequest("the distilled sampler generates no sound (diffusers' distilled Cosmos 3 pipeline has "
                             "no sound branch)", field="generate_sound")
    if sound and not world.sound_heads:
        raise InvalidRequest("the served checkpoint has no sound heads (sound_gen is off)", field="generate_sound")
    if sound and world.sound is None:
        raise InvalidRequest("the served checkpoint ships no sound tokenizer (sound_tokenizer/) to decode sound",
                             field="generate_sound")
    if _present(fields.get("sound_duration")):
        duration = as_float(fields["sound_duration"], "sound_duration")
        if not sound:
            raise InvalidRequest("needs generate_sound=true", field="sound_duration")
        clip = num_frames / fps
        tolerance = 1.0 / float(getattr(world.model.config, "sound_latent_fps", 25.0))  # one sound latent frame
        if abs(duration - clip) > tolerance:
            raise InvalidRequest(f"sound is generated for the whole clip, {num_frames} frames / {fps:g} fps = "
                                 f"{clip:g} s; got {duration:g} s", field="sound_duration")

    guardrails = extra.get("guardrails", False)
    if not isinstance(guardrails, bool):
        raise InvalidRequest("must be a boolean", field="extra_params.guardrails")
    if guardrails:
        notes.append("guardrails requested; this server runs no guardrail model (as vLLM-Omni with --no-guardrails)")

    image = video = None
    source = "input_reference"
    if kind == "video":
        given = [n for n in ("input_reference", "image_reference", "video_reference") if _present(fields.get(n))]
        if "video" in extra:
            given.append("extra_params.video")
        if len(given) > 1:
            raise InvalidRequest(f"give one conditioning input (an image or a video), got {' and '.join(given)}",
                                 field=given[1])
        if given:
            image, video, source = _conditioning(fields, extra)
    keep = extra.get("condition_video_keep", "first")
    frames_idx = extra.get("condition_frame_indexes_vision")
    if video is not None and isinstance(frames_idx, list) and frames_idx and isinstance(keep, str) \
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in frames_idx):
        need = 4 * max(frames_idx) + 1  # only these frames are encoded: drop the rest of the upload now
        video = video[:need] if keep == "first" else video[-need:]
    elif video is not None and frames_idx is None:
        video = video[:5] if keep == "first" else video[-5:]  # default condition frames (0, 1): 5 pixel frames

    kwargs: dict[str, Any] = {
        "prompt": prompt, "negative_prompt": negative if _present(negative) else None, "image": image,
        "video": video, "condition_latent_frames": frames_idx, "condition_video_keep": keep,
        "num_frames": num_frames, "height": height, "width": width, "fps": fps, "enable_sound": sound,
        "use_system_prompt": extra.get("use_system_prompt", True),
        "use_resolution_template": extra.get("use_resolution_template", False),
        "use_duration_template": extra.get("use_duration_template", False),
    }
    try:
        world_request(**kwargs)  # every check run_world makes on the request, now, before a job exists
    except RequestError as exc:
        name = _field_map(source, size_field).get((exc.field or "").split("[")[0], exc.field)
        msg = str(exc)[len(exc.field) + 2:] if exc.field else str(exc)
        raise InvalidRequest(msg, field=name) from exc
    if world.schedule is None:
        kwargs.update(steps=sampling["steps"], guidance=sampling["guidance"], shift=sampling["shift"])
    else:
        del kwargs["negative_prompt"]  # run_world_distilled has none: no unconditional branch to caption
    record = {"model": fields.get("model") or None, "prompt": prompt, "size": f"{width}x{height}",
              "seconds": f"{num_frames / fps:g}"}
    return GenerationRequest(kind, kwargs, seed, count, sound, record, sampling, notes)


# ------------------------------------------------------------------------------------------------
# Results


class _SoundWithYield:
    """The sound decoder with a yield point before its decode, so that the VAE's last frames and the sound
    decode are separate segments."""

    def __init__(self, inner: Any, before: Callable[[], None]) -> None:
        self._inner, self._before = inner, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, latents: Any) -> Any:
        self._before()
        return self._inner.decode(latents)


@dataclass
class GenerationOutcome:
    request_id: str
    kind: Kind
    mp4: bytes | None  # video jobs
    pngs: list[bytes]  # image jobs
    shape: list[int]  # [T, H, W, 3] of one output
    fps: float
    audio: dict[str, Any] | None  # {sample_rate, channels, seconds} of the MP4's AAC track
    seed: int
    mode: str  # text2video / image2video / video2video / text2image
    # queue_ms, model_ms (running, less paused_ms), paused_ms (waiting for policy work), postprocess_ms, total_ms,
    # segment_max_ms (the longest stretch a policy request arriving then had to wait for the device)
    timing: dict[str, float]
    stage_durations: dict[str, float]  # seconds
    notes: list[str]


class GenerationJob:
    """One queued or running generation: its request, a future for the outcome, a cancel flag."""

    def __init__(self, request: GenerationRequest, request_id: str,
                 on_progress: Callable[[int], None] | None = None) -> None:
        self.request, self.request_id, self.on_progress = request, request_id, on_progress
        self.future: Future = Future()
        self.enqueued = time.monotonic()
        self._cancel = threading.Event()

    def cancelled(self) -> bool:
        return self._cancel.is_set()


class GenerationWorker:
    """The generation thread: jobs one at a time, each step holding the device only while no policy work waits."""

    def __init__(self, world: WorldModel, gate: DeviceGate, *, max_jobs: int) -> None:
        if max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")
        self.world, self.gate, self.max_jobs = world, gate, max_jobs
        self._pending: deque[GenerationJob] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.running: GenerationJob | None = None
        self.jobs_run = 0
        # Longest stretch of device work between two points where generation could yield (a policy request
        # waits at most this long for the device).
        self.segment_max_ms = 0.0
        # Device time generation held, in segments (exported on /metrics: how much of the device generation got
        # next to policy traffic, also while no job finishes).
        self.segments, self.device_seconds = 0, 0.0
        # diffusers' Wan VAE decodes one latent frame per call of `vae.decoder`: a pre-hook there lets a long
        # decode give the device up between frames as the denoising loop does between steps.
        self._decode_yield: Callable[[], None] | None = None
        vae = getattr(world.encoder, "vae", None)
        decoder = getattr(vae, "decoder", None)
        self._hook = None
        if hasattr(decoder, "register_forward_pre_hook") and hasattr(vae, "clear_cache"):
            self._hook = decoder.register_forward_pre_hook(self._between_decoded_frames)
        self._thread = threading.Thread(target=self._loop, name="wamrt-generate", daemon=True)
        self._thread.start()

    def _between_decoded_frames(self, _module: Any, _args: Any) -> None:
        fn = self._decode_yield
        if fn is not None and threading.get_ident() == self._thread.ident:  # not the engine thread's FD decode
            fn()

    @property
    def depth(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, Any]:
        """What /metrics exports (`Metrics.watch_generation`)."""
        return {"jobs": self.jobs_run, "segments": self.segments, "device_seconds": self.device_seconds,
                "segment_max_seconds": self.segment_max_ms / 1e3, "running": int(self.running is not None),
                "queued": self.depth}

    def submit(self, job: GenerationJob) -> Future:
        with self._cond:
            if self._stopped:
                raise NotReady("server is shutting down")
            if len(self._pending) + (self.running is not None) >= self.max_jobs:
                raise Busy(f"{self.max_jobs} generation jobs queued or running (--max-generation-jobs); retry later")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, job: GenerationJob) -> None:
        """Stop a job: a queued one leaves the queue now, a running one at its next step boundary."""
        job._cancel.set()
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return  # running (it stops itself) or already finished
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(Cancelled("job cancelled"))

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            leftover, running = list(self._pending), self.running
            self._pending.clear()
            self._cond.notify_all()
        for job in leftover:
            job._cancel.set()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(NotReady("server is shutting down"))
        if running is not None:
            running._cancel.set()
        self._thread.join(timeout)
        if self._hook is not None:
            self._hook.remove()

    # --- generation thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self.running = self._pending.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None
                self.jobs_run += 1
                del job  # hold nothing of a finished job while waiting for the next

    def _run(self, job: GenerationJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            outcome = self._generate(job)
        except GenerationCancelled:
            # A fresh exception: the caught one's traceback would keep the unwound frames (and their tensors).
            job.future.set_exception(Cancelled("job cancelled"))
        except Exception as exc:  # noqa: BLE001  # the job's own error goes to its caller, typed
            if not isinstance(exc, ServingError | RequestError):
                log.exception("generation job %s failed", job.request_id)
            err = as_serving_error(exc)
            err.__traceback__ = err.__context__ = err.__cause__ = None
            job.future.set_exception(err)
        else:
            job.future.set_result(outcome)

    def _generate(self, job: GenerationJob) -> GenerationOutcome:
        import torch

        from ..pipeline.omni import model_device
        req, world, gate = job.request, self.world, self.gate
        started = time.monotonic()
        seed = req.seed if req.seed is not None else int(np.random.default_rng().integers(0, 2**31))
        total_steps, done, paused = req.steps * req.count, 0, 0.0
        held, seg_start = False, 0.0
        job_segment_max = 0.0  # this job's longest segment (the reply's timing.segment_max_ms)

        def acquire(cancellable: bool = True) -> None:
            """Wait until no policy work is queued or running, then hold the device for one segment."""
            nonlocal held, paused, seg_start
            t0 = time.monotonic()
            gate.acquire_generation(job.cancelled if cancellable else lambda: False)
            held, seg_start = True, time.monotonic()
            paused += seg_start - t0

        def yield_point() -> None:
            """Device work since the last point where a waiting policy request could have taken over."""
            nonlocal seg_start, job_segment_max
            now = time.monotonic()
            job_segment_max = max(job_segment_max, 1e3 * (now - seg_start))
            self.segment_max_ms = max(self.segment_max_ms, job_segment_max)
            self.segments += 1
            self.device_seconds += now - seg_start
            seg_start = now

        def release() -> None:
            nonlocal held
            yield_point()
            gate.release_generation()
            held = False

        def on_step(_i: int, _n: int) -> None:
            nonlocal done
            done += 1
            if job.on_progress is not None:
                job.on_progress(int(100 * done / (total_steps + 1)))  # 100 only once the output is encoded
            release()  # a segment ends here: waiting policy batches run now
            acquire()  # raises GenerationCancelled when the job was cancelled meanwhile

        vae = getattr(world.encoder, "vae", None)

        def decode_yield(keep_vae_cache: bool = True) -> None:
            """Between two latent frames of the VAE decode (see `_between_decoded_frames`), before the sound
            decode and, with `keep_vae_cache=False`, between two segments of one denoising step (the engine's
            `step_segments`; the step's state stays in the engine's graph buffers meanwhile): the device goes to
            policy work only while some waits."""
            if job.cancelled():  # still holding the device: drop a half-built cache, then stop
                if keep_vae_cache:
                    vae.clear_cache()
                raise GenerationCancelled("cancelled")
            if not gate.demand:
                yield_point()
                return
            # The VAE is shared with the policy path, whose encode resets the decoder's per-frame feature cache
            # (`clear_cache`): keep this decode's cache and put it back before going on (output bit-exact).
            saved = {name: getattr(vae, name) for name in _WAN_DECODE_STATE if keep_vae_cache and hasattr(vae, name)}
            release()
            # A kept cache must be restored under the device; cancel is then checked at the next frame.
            acquire(cancellable=not keep_vae_cache)
            for name, value in saved.items():
                setattr(vae, name, value)

        sound = None
        if req.sound:
            sound = _SoundWithYield(world.sound, lambda: decode_yield(keep_vae_cache=False))

        def mid_step() -> None:
            decode_yield(keep_vae_cache=False)

        if job.on_progress is not None:
            job.on_progress(0)  # started
        outputs: list[tuple[np.ndarray, np.ndarray | None]] = []
        stages: dict[str, float] = {}
        run_notes: list[str] = []  # what the runs themselves report (a tiled decode), once each
        mode = "text2image"
        self._decode_yield = decode_yield if self._hook is not None else None
        try:
            for k in range(req.count):
                acquire()
                generator = torch.Generator().manual_seed(seed + k)
                extra = {"sound_decoder": sound} if world.schedule is None else {}  # distilled: no sound
                result = world.run(**req.kwargs, **extra, generator=generator, on_step=on_step, on_segment=mid_step)
                release()
                assert result.frames is not None
                outputs.append((result.frames.numpy(),
                                None if result.sound is None else result.sound.numpy()))
                for key, ms in result.timings_ms.items():
                    stages[key] = stages.get(key, 0.0) + ms / 1e3
                run_notes += [n for n in result.notes if n not in run_notes]
                del result
        finally:
            self._decode_yield = None
            if held:
                release()
        if req.kwargs.get("video") is not None:
            mode = "video2video"
        elif req.kwargs.get("image") is not None:
            mode = "image2video"
        elif req.kwargs["num_frames"] > 1:
            mode = "text2video"
        model_s = time.monotonic() - started - paused

        t0 = time.monotonic()
        mp4, pngs, audio = None, [], None
        frames, wave = outputs[0]
        if req.kind == "image":
            pngs = [encode_png(f[0]) for f, _ in outputs]
        else:
            rate = world.sound.sampling_rate if wave is not None else None
            # x264 threads: one on a CPU-only server (the cores run the model), FFmpeg's choice next to a GPU.
            threads = 0 if model_device(world.model).type == "cuda" else 1
            mp4 = encode_mp4(frames, req.fps, wave, rate, threads=threads)
            if wave is not None:
                assert rate is not None
                audio = {"sample_rate": audio_rate(rate), "decoder_sample_rate": rate, "channels": min(2, len(wave)),
                         "seconds": wave.shape[1] / rate}
        post_ms = 1e3 * (time.monotonic() - t0)
        stages["encode"] = post_ms / 1e3
        total_ms = 1e3 * (time.monotonic() - job.enqueued)
        timing = {"queue_ms": 1e3 * (started - job.enqueued), "model_ms": 1e3 * model_s, "paused_ms": 1e3 * paused,
                  "postprocess_ms": post_ms, "total_ms": total_ms, "segment_max_ms": job_segment_max}
        return GenerationOutcome(job.request_id, req.kind, mp4, pngs, list(frames.shape), req.fps, audio, seed, mode,
                                 timing, stages, list(req.notes) + run_notes)

