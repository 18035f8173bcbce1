"""Forward- and inverse-dynamics requests for `/v1/videos` (vLLM-Omni `extra_params.action_mode`).

* `forward_dynamics`: image (`input_reference` / `image_reference`, or a video whose first frame is
  used) + `extra_params.action` [T, raw_action_dim] -> the predicted video, chunk + 1 frames, served
  as an MP4 by `/v1/videos/{id}/content` (the job record's `action` stays null: the actions were the
  input, as in diffusers).
* `inverse_dynamics`: video of chunk + 1 frames (`input_reference` MP4 upload, `video_reference`
  `{"video_url": "data:video/mp4;base64,..."}`, or `extra_params.video` as a uint8 [T, H, W, 3]
  array) -> actions [chunk, raw_action_dim] in the job record's `action`.

Both run the generic diffusers contract (`wamrt.pipeline.generic`), one request at a time on the
engine thread (their shapes differ from the DROID policy bucket, so they are never batched). Decoding
uploads, validating and MP4 encoding run in worker threads, never on the event loop.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..client.wire import WireError, json_array
from ..pipeline.domains import DOMAIN_IDS, RAW_ACTION_DIMS, resolve_domain
from ..pipeline.errors import RequestError
from ..pipeline.generic import TIERS, generic_request
from .errors import InvalidRequest
from .fields import as_float, as_int
from .limits import DEFAULT_LIMITS, SAMPLER_RANGES, Limits, check_prompt, loads_json, open_image
from .media import encode_mp4, require_pyav  # noqa: F401  # encode_mp4 re-exported: MP4 encoding lives in media.py

DYNAMICS_MODES = ("forward_dynamics", "inverse_dynamics")
MAX_CHUNK = 256  # actions per request (chunk + 1 video frames); bounds decode and memory
MAX_PIXELS = 1920 * 1088  # per input frame
DEFAULT_SAMPLER = {"steps": 4, "guidance": 3.0, "shift": 5.0}  # diffusers' action defaults
VIDEO_FPS = 15  # MP4 frame rate when the request gives none (DROID's conditioning rate)


@dataclass
class DynamicsRequest:
    """One validated FD/ID request: the keyword arguments of `run_generic`, minus the model."""

    mode: str
    kwargs: dict[str, Any]  # prompt, domain, chunk_size, image/video, raw_actions, tier, sampler, ...
    seed: int | None
    domain_id: int
    raw_action_dim: int
    fps: float
    record: dict[str, Any] = field(default_factory=dict)  # model, prompt, size, seconds for the job record


def _domain(extra: dict[str, Any]) -> str:
    if "domain_name" in extra:
        return extra["domain_name"]
    if "domain_id" in extra:
        wanted = extra["domain_id"]
        if not isinstance(wanted, int) or isinstance(wanted, bool):
            raise InvalidRequest(f"must be an integer, got {wanted!r}", field="extra_params.domain_id")
        for name, did in DOMAIN_IDS.items():
            if did == wanted and name in RAW_ACTION_DIMS:
                return name
        raise InvalidRequest(f"no action domain has id {wanted!r}", field="extra_params.domain_id")
    return "droid_lerobot"


def decode_video(raw: bytes, name: str, *, max_frames: int = MAX_CHUNK + 1, keep: str = "first",
                 max_pixels: int | None = None, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """MP4 (or any container PyAV reads) -> uint8 [T, H, W, 3], decoding only what is used: the first
    `max_frames` (decoding stops there) or, with `keep="last"`, the last ones (earlier frames are dropped as
    they are decoded). The frame size comes from the stream header and is checked before decoding; frames x
    pixels decoded are bounded by `limits.decoded_pixels`, so a small file claiming 257 frames of 1080p costs
    a 400, not gigabytes; `max_pixels` (--max-video-pixels) bounds the pixels of the frames kept."""
    require_pyav(name)
    from collections import deque

    import av

    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.video:
                raise InvalidRequest("holds no video stream", field=name)
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > min(MAX_PIXELS, limits.image_pixels):
                raise InvalidRequest(f"{width}x{height} frames are over {min(MAX_PIXELS, limits.image_pixels)} pixels",
                                     field=name)
            budget = max(1, limits.decoded_pixels // max(width * height, 1))  # frames this upload may decode
            if keep == "first" and max_frames > budget:
                max_frames = budget + 1  # decode one past the budget: a longer video is refused below
            frames: deque[np.ndarray] = deque(maxlen=max_frames if keep == "last" else None)
            decoded = 0
            for frame in container.decode(stream):
                decoded += 1
                if decoded > budget:
                    raise InvalidRequest(f"more than {budget} frames of {width}x{height} to decode (a "
                                         f"{limits.decoded_pixels}-pixel budget per upload)", field=name)
                if max_pixels is not None and (len(frames) + 1) * width * height > max_pixels:
                    raise InvalidRequest(f"its frames hold more than this server's {max_pixels} pixels "
                                         f"(--max-video-pixels)", field=name)
                frames.append(frame.to_ndarray(format="rgb24"))
                if keep == "first" and len(frames) >= max_frames:
                    break
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001  # av.error.* and friends: not a readable video
        raise InvalidRequest(f"not a readable image or video ({type(exc).__name__})", field=name) from None
    if not frames:
        raise InvalidRequest("holds no frames", field=name)
    return np.stack(frames)


def _data_url(value: Any, name: str, key: str) -> bytes:
    ref = loads_json(value, field=name) if isinstance(value, str) else value
    url = ref.get(key, "") if isinstance(ref, dict) else ""
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise InvalidRequest(f"only data: URLs are accepted in {key}", field=name)
    try:
        raw = base64.b64decode(url.split(",", 1)[1], validate=True)
    except ValueError as exc:
        raise InvalidRequest(f"bad base64 ({exc})", field=name) from exc
    if not raw:
        raise InvalidRequest("is empty", field=name)
    return raw


def _media(raw: bytes, name: str, frames: int, keep: str, limits: Limits) -> tuple[np.ndarray | None,
                                                                                   np.ndarray | None]:
    """Upload bytes -> (image, None) for a still image, (None, video) for a video (`decode_video`)."""
    if not raw:
        raise InvalidRequest("is empty", field=name)
    image = open_image(raw, name, min(MAX_PIXELS, limits.image_pixels), allow_frames=True)
    if image is not None:
        return image, None
    return None, decode_video(raw, name, max_frames=frames, keep=keep, limits=limits)


def _conditioning(fields: dict[str, Any], extra: dict[str, Any], *, frames: int = MAX_CHUNK + 1,
                  keep: str = "first", limits: Limits = DEFAULT_LIMITS
                  ) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """(image, video, field name) from the request's upload / references / inline arrays; of an uploaded video
    only the `frames` at the `keep` end ("first" / "last") are decoded."""
    if "video" in extra:
        try:
            video = json_array(extra["video"], "extra_params.video", max_pixels=limits.image_pixels)
        except WireError as exc:
            raise InvalidRequest(exc.args[0], field="extra_params.video") from exc
        if not isinstance(video, np.ndarray) or video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
            got = f"{video.dtype} {video.shape}" if isinstance(video, np.ndarray) else type(video).__name__
            raise InvalidRequest(f"must be uint8 [T, H, W, 3], got {got}", field="extra_params.video")
        return None, video, "extra_params.video"
    upload = fields.get("input_reference")
    if isinstance(upload, bytes | bytearray):
        image, video = _media(bytes(upload), "input_reference", frames, keep, limits)
        return image, video, "input_reference"
    if upload == "":
        raise InvalidRequest("is empty", field="input_reference")
    if fields.get("video_reference"):
        raw = _data_url(fields["video_reference"], "video_reference", "video_url")
        return None, decode_video(raw, "video_reference", max_frames=frames, keep=keep, limits=limits), \
            "video_reference"
    if fields.get("image_reference") or isinstance(upload, str):
        name = "image_reference" if fields.get("image_reference") else "input_reference"
        image, video = _media(_data_url(fields.get(name), name, "image_url"), name, frames, keep, limits)
        return image, video, name
    return None, None, "input_reference"


def build_dynamics(fields: dict[str, Any], extra: dict[str, Any], mode: str, defaults: dict[str, Any], *,
                   limits: Limits = DEFAULT_LIMITS, tokenizer: Any = None) -> DynamicsRequest:
    """Form/JSON fields of a FD/ID `/v1/videos` request -> a validated `DynamicsRequest` (typed 400s).

    CPU work (decoding uploads, PIL conversion, tokenizing the prompts with `tokenizer`): call it off the
    event loop."""
    prompt = fields["prompt"]
    check_prompt(prompt, "prompt", tokenizer, limits.prompt_tokens)
    domain = _domain(extra)
    try:
        dom = resolve_domain(domain)
    except RequestError as exc:
        raise InvalidRequest(str(exc)[len("domain: "):], field="extra_params.domain_name") from exc
    rad = extra.get("raw_action_dim", dom.raw_action_dim)
    if not isinstance(rad, int) or isinstance(rad, bool) or rad != dom.raw_action_dim:
        raise InvalidRequest(f"must be {dom.raw_action_dim} for domain {dom.name!r}",
                             field="extra_params.raw_action_dim")
    # FD conditions on one frame: of a video upload only the first is decoded. ID decodes one frame past the
    # longest chunk, so that a longer video is refused (below) rather than cut.
    image, video, source = _conditioning(fields, extra, frames=1 if mode == "forward_dynamics" else MAX_CHUNK + 2,
                                         limits=limits)
    raw_actions = None
    if mode == "inverse_dynamics":
        if video is None:
            what = "an image" if image is not None else "nothing"
            raise InvalidRequest(f"inverse_dynamics needs a video of chunk + 1 frames, got {what}", field=source)
        if "action" in extra:
            raise InvalidRequest("inverse_dynamics predicts the actions; do not send them", field="extra_params.action")
        chunk = len(video) - 1
        if "action_chunk_size" in extra:
            want = as_int(extra["action_chunk_size"], "extra_params.action_chunk_size", 1, MAX_CHUNK)
            if len(video) != want + 1:
                raise InvalidRequest(f"video has {len(video)} frames; action_chunk_size {want} needs {want + 1}",
                                     field=source)
            chunk = want
    else:
        if image is None and video is None:
            raise InvalidRequest("forward_dynamics needs a conditioning image", field=source)
        if "action" not in extra:
            raise InvalidRequest(f"forward_dynamics needs the actions [T, {dom.raw_action_dim}]",
                                 field="extra_params.action")
        try:
            raw_actions = np.asarray(extra["action"], dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"must be a numeric [T, {dom.raw_action_dim}] array",
                                 field="extra_params.action") from exc
        if raw_actions.ndim != 2 or raw_actions.shape[1] != dom.raw_action_dim or len(raw_actions) < 1:
            raise InvalidRequest(f"must be [T, {dom.raw_action_dim}] for domain {dom.name!r}, got "
                                 f"{list(raw_actions.shape)}", field="extra_params.action")
        if not np.isfinite(raw_actions).all():
            raise InvalidRequest("contains NaN or inf", field="extra_params.action")
        chunk = len(raw_actions)
        if "action_chunk_size" in extra:
            want = as_int(extra["action_chunk_size"], "extra_params.action_chunk_size", 1, MAX_CHUNK)
            if want != chunk:
                raise InvalidRequest(f"{chunk} action rows but action_chunk_size {want}", field="extra_params.action")
    if not 1 <= chunk <= MAX_CHUNK or chunk % 4:
        raise InvalidRequest(f"the chunk must be a multiple of 4 (the VAE's temporal stride) in [4, {MAX_CHUNK}], "
                             f"got {chunk}", field=source if mode == "inverse_dynamics" else "extra_params.action")
    if fields.get("num_frames") not in (None, ""):
        nf = as_int(fields["num_frames"], "num_frames", 1, MAX_CHUNK + 1)
        if nf not in (chunk, chunk + 1):  # vLLM-Omni's rule: action_chunk_size in {num_frames - 1, num_frames}
            raise InvalidRequest(f"{nf} frames do not fit a chunk of {chunk} actions", field="num_frames")
    tier = as_int(extra.get("image_size", extra.get("resolution", 480)), "extra_params.image_size", 1, 10_000)
    if tier not in TIERS:
        raise InvalidRequest(f"must be one of {list(TIERS)}", field="extra_params.image_size")
    fps = as_float(fields["fps"], "fps", *SAMPLER_RANGES["fps"]) if fields.get("fps") not in (None, "") else None
    sampler = dict(DEFAULT_SAMPLER)
    sampler.update({k: v for k, v in defaults.items() if k in sampler})
    for top, key in (("num_inference_steps", "steps"), ("guidance_scale", "guidance"), ("flow_shift", "shift")):
        if fields.get(top) not in (None, ""):
            sampler[key] = fields[top]
    for key, name in (("num_steps", "steps"), ("guidance", "guidance"), ("shift", "shift")):
        if key in extra:
            sampler[name] = extra[key]
    sampler["steps"] = as_int(sampler["steps"], "num_inference_steps", 1, limits.policy_steps)
    sampler["guidance"] = as_float(sampler["guidance"], "guidance_scale", *SAMPLER_RANGES["guidance"])
    sampler["shift"] = as_float(sampler["shift"], "flow_shift", *SAMPLER_RANGES["shift"])
    if "guidance_interval" in extra:
        raise InvalidRequest("guidance_interval applies to action_mode 'policy' only",
                             field="extra_params.guidance_interval")
    view_point = extra.get("view_point", extra.get("action_view_point", "ego_view"))
    if view_point is not None and not isinstance(view_point, str):
        raise InvalidRequest("must be a string", field="extra_params.view_point")
    use_system_prompt = extra.get("use_system_prompt", False)
    if not isinstance(use_system_prompt, bool):
        raise InvalidRequest("must be a boolean", field="extra_params.use_system_prompt")
    negative = fields.get("negative_prompt") or None
    if negative is not None and not isinstance(negative, str):
        raise InvalidRequest("must be a string", field="negative_prompt")
    if negative is not None:
        check_prompt(negative, "negative_prompt", tokenizer, limits.prompt_tokens)
    kwargs: dict[str, Any] = {
        "prompt": prompt, "domain": dom.name, "chunk_size": chunk, "image": image,
        "video": video, "raw_actions": raw_actions, "resolution_tier": tier,
        "view_point": view_point, "negative_prompt": negative, "use_system_prompt": use_system_prompt, **sampler,
    }
    if fps is not None:
        kwargs["fps"] = fps
    if mode == "forward_dynamics" and video is not None:  # FD conditions on the first frame only
        kwargs["image"], kwargs["video"] = video[0], None
    try:
        req = generic_request(**{k: v for k, v in kwargs.items() if k not in DEFAULT_SAMPLER}, mode=mode)
    except RequestError as exc:
        name = {"image": source, "video": source, "raw_actions": "extra_params.action",
                "domain": "extra_params.domain_name", "view_point": "extra_params.view_point",
                "fps": "fps", "prompt": "prompt", "negative_prompt": "negative_prompt"}.get(exc.field or "", exc.field)
        msg = str(exc)[len(exc.field) + 2:] if exc.field else str(exc)
        raise InvalidRequest(msg, field=name) from exc
    seed = as_int(fields["seed"], "seed", 0, 2**63 - 1) if fields.get("seed") not in (None, "") else None
    canvas = req.canvas
    record = {"model": fields.get("model"), "prompt": prompt,
              "size": fields.get("size") or f"{canvas.content_w}x{canvas.content_h}",
              "seconds": str(fields.get("seconds") or "4")}
    return DynamicsRequest(mode, kwargs, seed, dom.domain_id, dom.raw_action_dim,
                           fps if fps is not None else VIDEO_FPS, record)


def generic_runner(policy: Any) -> Any:
    """The policy's `generic(mode, **request)`, or one built from an engine's model/encoder/tokenizer."""
    if hasattr(policy, "generic"):
        return policy.generic
    if all(hasattr(policy, a) for a in ("model", "encoder", "tokenizer")):
        from ..pipeline.generic import run_generic

        def run(mode: str, **request: Any) -> Any:
            return run_generic(policy.model, policy.encoder, policy.tokenizer, mode=mode, **request)

        return run
    return None
