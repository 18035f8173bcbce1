"""Generation request fields -> a validated `GenerationRequest` (`build_generation`), with vLLM-Omni's field
names for `/v1/videos`, `/v1/videos/sync` and `/v1/images/generations`.

Field parsing decodes uploads and validates everything the pipeline would refuse before a job exists, naming
the field as the client sent it; call it off the event loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..pipeline.errors import RequestError
from .dynamics import _conditioning
from .errors import InvalidRequest
from .fields import as_float, as_int
from .limits import DEFAULT_LIMITS, SAMPLER_RANGES, GenerationCost, Limits, check_prompt, loads_json
from .transfer_fields import CHUNK_KEYS, TRANSFER_KEYS, TransferFields, transfer_field, transfer_fields
from .world_model import WorldModel

if TYPE_CHECKING:
    from ..sampler import DistilledSchedule

Kind = Literal["video", "image"]
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
              "max_sequence_length", "video", *TRANSFER_KEYS, *CHUNK_KEYS)
# vLLM-Omni request fields for features this runtime does not have: refused, never silently dropped.
UNSUPPORTED = ("guidance_scale_2", "true_cfg_scale", "boundary_ratio", "audio_reference", "lora",
               "enable_frame_interpolation", "frame_interpolation_exp", "frame_interpolation_scale",
               "frame_interpolation_model_path", "aspect_ratio", "short_edge", "start_time_seconds")
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")



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
    upsample: bool = False  # upsample_prompt: the Reasoner rewrites the prompt as a structured caption first
    chunks: int = 1  # a long video made in chunks: how many (each runs `steps` steps)

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
        seconds = as_float(fields["seconds"], "seconds", 0.0, MAX_FRAMES / fps)
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
        extra = loads_json(extra, field="extra_params")
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
    steps = as_int(fields["num_inference_steps"], "num_inference_steps", *SAMPLER_RANGES["generation_steps"]) \
        if _present(fields.get("num_inference_steps")) else None
    guidance = as_float(fields["guidance_scale"], "guidance_scale", *SAMPLER_RANGES["guidance"]) \
        if _present(fields.get("guidance_scale")) else None
    shift_src = "flow_shift" if _present(fields.get("flow_shift")) else "extra_params.flow_shift"
    shift_val = fields.get("flow_shift") if _present(fields.get("flow_shift")) else extra.get("flow_shift")
    shift = as_float(shift_val, shift_src, *SAMPLER_RANGES["shift"]) if _present(shift_val) else None
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
                     max_pixels: int, model_name: str = "", limits: Limits = DEFAULT_LIMITS,
                     cost: GenerationCost | None = None) -> GenerationRequest:
    """Form/JSON fields of a generation request -> a validated `GenerationRequest`, or `InvalidRequest` naming
    the field. `limits` bounds the prompts' tokens and the decoded uploads, `cost` the time of a step and of
    the job. CPU work (tokenizing, decoding uploads, PIL conversion): call it off the event loop."""
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
    text_tokens = check_prompt(prompt, "prompt", world.tokenizer, limits.prompt_tokens)
    if _present(negative):
        text_tokens = max(text_tokens, check_prompt(negative, "negative_prompt", world.tokenizer, limits.prompt_tokens))
    for name in UNSUPPORTED:
        if _present(fields.get(name)):
            raise InvalidRequest("is not supported by this runtime", field=name)
    extra = _extra(fields) if kind == "video" else {}
    notes: list[str] = []
    defaults = VIDEO_DEFAULTS if kind == "video" else IMAGE_DEFAULTS
    if world.default_shift is not None:
        defaults = {**defaults, "shift": world.default_shift}
    sound = _sound(fields, world, kind)
    transfer = TransferFields()
    if kind == "video":
        transfer = transfer_fields(fields, extra, max_pixels=max_pixels, max_frames=MAX_FRAMES, sound=sound)
    elif _present(fields.get("control_reference")):
        raise InvalidRequest("video transfer makes videos (/v1/videos)", field="control_reference")
    if world.schedule is not None and "num_video_frames_per_chunk" in transfer.kwargs:
        raise InvalidRequest("long videos in chunks run with the UniPC sampler; the served checkpoint is distilled",
                             field="extra_params.num_video_frames_per_chunk")
    if transfer.hints:
        if world.schedule is not None:
            raise InvalidRequest("video transfer runs with the UniPC sampler; the served checkpoint is distilled",
                                 field=f"extra_params.{transfer.hints[0]}")
        defaults = {**defaults, **transfer.defaults, **_transfer_shape(transfer)}

    fps = as_float(fields["fps"], "fps", *SAMPLER_RANGES["fps"]) if _present(fields.get("fps")) else defaults["fps"]
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
    keep = extra.get("condition_video_keep", "first")
    frames_idx = extra.get("condition_frame_indexes_vision")
    if kind == "video":
        for name in ("input_reference", "image_reference", "video_reference"):
            if name in fields and fields[name] in ("", b""):
                raise InvalidRequest("is empty", field=name)  # an empty upload is a mistake, not "no reference"
    if transfer.hints and "video" in extra:
        raise InvalidRequest("video transfer takes its source in input_reference", field="extra_params.video")
    if kind == "video" and not transfer.hints:
        given = [n for n in ("input_reference", "image_reference", "video_reference") if _present(fields.get(n))]
        if "video" in extra:
            given.append("extra_params.video")
        if len(given) > 1:
            raise InvalidRequest(f"give one conditioning input (an image or a video), got {' and '.join(given)}",
                                 field=given[1])
        if given:
            # Only the frames that become clean latents are decoded: 4 * max(index) + 1 at the `keep` end
            # (default indexes (0, 1): 5 frames); the rest of an upload is never decoded.
            need = 5
            if isinstance(frames_idx, list) and frames_idx and all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_FRAMES for i in frames_idx):
                need = 4 * max(frames_idx) + 1
            image, video, source = _conditioning(fields, extra, frames=need,
                                                 keep=keep if keep in ("first", "last") else "first", limits=limits)
            if video is not None:
                video = video[:need] if keep != "last" else video[-need:]  # inline arrays arrive whole

    kwargs: dict[str, Any] = {
        "prompt": prompt, "negative_prompt": negative if _present(negative) else None, "image": image,
        "video": video, "condition_latent_frames": frames_idx, "condition_video_keep": keep,
        "num_frames": num_frames, "height": height, "width": width, "fps": fps, "enable_sound": sound,
        "use_system_prompt": extra.get("use_system_prompt", True),
        "use_resolution_template": extra.get("use_resolution_template", False),
        "use_duration_template": extra.get("use_duration_template", False), **transfer.kwargs,
    }
    try:
        checked = world_request(**kwargs)  # every check run_world makes on the request, now, before a job exists
    except RequestError as exc:
        base = (exc.field or "").split("[")[0]
        name = _field_map(source, size_field).get(base) or transfer_field(base) or exc.field
        msg = str(exc)[len(exc.field) + 2:] if exc.field else str(exc)
        raise InvalidRequest(msg, field=name) from exc
    chunks = 1 if checked.chunks is None else len(checked.chunks.spans)
    if cost is not None:  # one step (of one chunk), and the whole job, within this server's time bounds
        cost.check(num_frames=num_frames if chunks == 1 else checked.chunks.frames, height=height, width=width,
                   steps=sampling["steps"], count=count * chunks, text_tokens=text_tokens,
                   branches=1 if world.schedule is not None else 2, size_field=size_field)
    if checked.transfer is not None:
        sampling.update(controls=list(checked.transfer.keys), control_guidance=checked.transfer.control_guidance)
    if chunks > 1:
        sampling.update(chunks=chunks, chunk_frames=checked.chunks.frames)
    if world.schedule is None:
        kwargs.update(steps=sampling["steps"], guidance=sampling["guidance"], shift=sampling["shift"])
    else:
        del kwargs["negative_prompt"]  # run_world_distilled has none: no unconditional branch to caption
    record = {"model": fields.get("model") or None, "prompt": prompt, "size": f"{width}x{height}",
              "seconds": f"{num_frames / fps:g}"}
    upsample = _bool(fields["upsample_prompt"], "upsample_prompt") if _present(fields.get("upsample_prompt")) else False
    return GenerationRequest(kind, kwargs, seed, count, sound, record, sampling, notes, upsample, chunks)


def _sound(fields: dict[str, Any], world: WorldModel, kind: Kind) -> bool:
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
    return sound


def _transfer_shape(transfer: TransferFields) -> dict[str, int]:
    """A transfer request's default frames (the source's, 4k + 1, at least 5) and size (the framework's 720p
    template closest to the source's aspect)."""
    from ..pipeline.geometry import framework_bucket

    assert transfer.frames is not None and transfer.source_hw is not None
    bucket = framework_bucket(*transfer.source_hw, "720")
    return {"num_frames": max(5, 4 * ((min(transfer.frames, MAX_FRAMES) - 1) // 4) + 1), "height": bucket.height,
            "width": bucket.width}
