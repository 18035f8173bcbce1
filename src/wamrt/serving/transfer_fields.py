"""The video transfer and long-video fields of a `/v1/videos` request, as vLLM-Omni's Cosmos 3 server names them
-> `run_world` keywords (`generation_request.build_generation` calls this).

* `extra_params.edge` / `blur` / `depth` / `seg`: `true` or `{control_weight, preset_edge_threshold |
  preset_blur_strength}`. A path is refused: no request field reads a file of the server. Controls are uploads:
  multipart `control_reference` (a video file, repeatable; JSON: `{"video_url": "data:..."}`) with `control_type`
  (the hint it is for, repeated in the same order); an uploaded hint needs no `extra_params` entry.
* the source video (what edge / blur are computed from) in `input_reference` (or `video_reference`); with transfer
  it is the source, not a conditioning video.
* `extra_params.control_guidance`, `control_guidance_interval` ([lo, hi] timesteps), `emphasize_control_in_prompt`.
* `extra_params.num_video_frames_per_chunk` (93 for transfer by default, as the peers; off otherwise) and
  `num_conditional_frames` (1): long videos in chunks, also for image / video -> video.

Transfer runs the recipe's defaults where the request gives none (guidance 3, flow shift 10; the single hint's
control guidance), makes as many frames as the source has (4k + 1, at most the server's frame limit) and picks the
output size from the source's aspect (the framework's 720p templates). It does not combine with sound or actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..pipeline.controls import COMPUTED_HINTS, HINT_KEYS, TRANSFER_GUIDANCE, TRANSFER_SHIFT
from .dynamics import MAX_CHUNK, _data_url, decode_video
from .errors import InvalidRequest
from .fields import as_float, as_int

CHUNK_KEYS = ("num_video_frames_per_chunk", "num_conditional_frames")
TRANSFER_KEYS = (*HINT_KEYS, "control_guidance", "control_guidance_interval", "emphasize_control_in_prompt")
TRANSFER_CHUNK_FRAMES = 93  # the peers' chunk
HINT_OPTIONS = {"control_weight", "preset_edge_threshold", "preset_blur_strength"}


@dataclass
class TransferFields:
    """What the transfer / chunk fields add to a generation request."""

    kwargs: dict[str, Any] = field(default_factory=dict)  # run_world keywords
    hints: tuple[str, ...] = ()  # () without transfer
    frames: int | None = None  # frames of the source (or the shortest uploaded control): the default num_frames
    source_hw: tuple[int, int] | None = None  # (height, width) the default size is chosen for
    defaults: dict[str, float] = field(default_factory=dict)  # sampler defaults the recipe sets (guidance, shift)


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def _hint(value: Any, key: str) -> dict[str, Any]:
    name = f"extra_params.{key}"
    if value is True:
        return {}
    if isinstance(value, str):
        raise InvalidRequest("paths are not read: upload the control video as control_reference with control_type "
                             f"{key}, or send true to compute it from input_reference", field=name)
    if not isinstance(value, dict):
        raise InvalidRequest(f"must be true or an object of options ({', '.join(sorted(HINT_OPTIONS))})", field=name)
    for option in value:
        if option not in HINT_OPTIONS:
            raise InvalidRequest(f"unknown option; known: {', '.join(sorted(HINT_OPTIONS))}", field=f"{name}.{option}")
    if "control_weight" in value:
        weight = as_float(value["control_weight"], f"{name}.control_weight")
        if weight < 0:
            raise InvalidRequest(f"must be >= 0, got {weight}", field=f"{name}.control_weight")
        value = {**value, "control_weight": weight}
    return dict(value)


def _decode(raw: bytes, name: str, first: int | None, max_pixels: int) -> np.ndarray:
    """The first `first` frames (decoding stops there), or all of at most MAX_CHUNK + 1."""
    frames = decode_video(raw, name, max_frames=MAX_CHUNK + 2 if first is None else first, max_pixels=max_pixels)
    if first is None and len(frames) > MAX_CHUNK + 1:
        raise InvalidRequest(f"more than {MAX_CHUNK + 1} frames", field=name)
    return frames


def _uploads(fields: dict[str, Any], max_pixels: int, first: int | None) -> dict[str, np.ndarray]:
    refs = [] if fields.get("control_reference") in (None, "", b"") else _as_list(fields["control_reference"])
    types = [] if fields.get("control_type") in (None, "") else _as_list(fields["control_type"])
    if len(refs) != len(types):
        raise InvalidRequest(f"{len(refs)} control_reference uploads but {len(types)} control_type values: give "
                             "one type per upload, in the same order", field="control_type")
    out: dict[str, np.ndarray] = {}
    for ref, kind in zip(refs, types, strict=True):
        if kind not in HINT_KEYS:
            raise InvalidRequest(f"must be one of {', '.join(HINT_KEYS)}, got {kind!r}", field="control_type")
        if kind in out:
            raise InvalidRequest(f"two {kind} controls uploaded", field="control_type")
        raw = bytes(ref) if isinstance(ref, bytes | bytearray) else _data_url(ref, "control_reference", "video_url")
        out[kind] = _decode(raw, "control_reference", first, max_pixels)
    return out


def _source(fields: dict[str, Any], max_pixels: int, first: int | None) -> np.ndarray | None:
    if fields.get("image_reference") not in (None, ""):
        raise InvalidRequest("video transfer computes its controls from a video: send it as input_reference",
                             field="image_reference")
    upload = fields.get("input_reference")
    if isinstance(upload, bytes | bytearray) and upload:
        raw, name = bytes(upload), "input_reference"
    elif fields.get("video_reference") not in (None, ""):
        raw, name = _data_url(fields["video_reference"], "video_reference", "video_url"), "video_reference"
    elif upload not in (None, "", b""):
        raise InvalidRequest("upload the source video (multipart), or send it as video_reference",
                             field="input_reference")
    else:
        return None
    frames = _decode(raw, name, first, max_pixels)
    if len(frames) == 1:
        raise InvalidRequest("video transfer needs a source video, got a single frame", field=name)
    return frames


def transfer_fields(fields: dict[str, Any], extra: dict[str, Any], *, max_pixels: int, max_frames: int,
                    sound: bool) -> TransferFields:
    """The request's transfer and chunk fields -> `TransferFields` (empty `hints` without transfer). Decodes the
    uploads (CPU work: call it off the event loop)."""
    out = TransferFields()
    chunk = extra.get("num_video_frames_per_chunk")
    if chunk is not None:
        out.kwargs["num_video_frames_per_chunk"] = as_int(chunk, "extra_params.num_video_frames_per_chunk", 5,
                                                          max_frames)
    if extra.get("num_conditional_frames") is not None:
        out.kwargs["num_conditional_frames"] = as_int(extra["num_conditional_frames"],
                                                      "extra_params.num_conditional_frames", 0, max_frames)
    hints = {k: _hint(extra[k], k) for k in HINT_KEYS if k in extra}
    frames_wanted = None
    if fields.get("num_frames") not in (None, ""):
        frames_wanted = as_int(fields["num_frames"], "num_frames", 1, max_frames)
    uploads = _uploads(fields, max_pixels, frames_wanted or max_frames)
    if not hints and not uploads:
        for key in TRANSFER_KEYS[len(HINT_KEYS):]:
            if key in extra:
                raise InvalidRequest("is a video transfer option: add a hint (edge, blur, depth, seg)",
                                     field=f"extra_params.{key}")
        return out
    for key, video in uploads.items():
        hints.setdefault(key, {})["video"] = video
    if sound:
        raise InvalidRequest("video transfer generates no sound", field="generate_sound")
    source = _source(fields, max_pixels, frames_wanted or max_frames)
    for key, opts in hints.items():
        if "video" in opts:
            continue
        if key not in COMPUTED_HINTS:
            raise InvalidRequest(f"needs its video uploaded as control_reference with control_type {key}",
                                 field=f"extra_params.{key}")
        if source is None:
            raise InvalidRequest("is computed from the source video: send it as input_reference, or upload the "
                                 "control", field=f"extra_params.{key}")
    videos = [source] if source is not None else []
    videos += [opts["video"] for opts in hints.values() if "video" in opts]
    out.hints = tuple(k for k in HINT_KEYS if k in hints)
    out.frames = min(len(v) for v in videos)
    out.source_hw = tuple(videos[0].shape[1:3])  # type: ignore[assignment]
    out.defaults = {"guidance": TRANSFER_GUIDANCE, "shift": TRANSFER_SHIFT}
    out.kwargs.update(controls={k: hints[k] for k in out.hints},
                      control_source=source if any("video" not in hints[k] for k in out.hints) else None)
    out.kwargs.setdefault("num_video_frames_per_chunk", TRANSFER_CHUNK_FRAMES)
    if extra.get("control_guidance") is not None:
        out.kwargs["control_guidance"] = as_float(extra["control_guidance"], "extra_params.control_guidance")
    if extra.get("control_guidance_interval") is not None:
        value = extra["control_guidance_interval"]
        if not isinstance(value, list) or len(value) != 2:
            raise InvalidRequest(f"must be [lo, hi] (timesteps, 0-1000), got {value!r}",
                                 field="extra_params.control_guidance_interval")
        out.kwargs["control_guidance_interval"] = [as_float(v, "extra_params.control_guidance_interval")
                                                   for v in value]
    if "emphasize_control_in_prompt" in extra:
        if not isinstance(extra["emphasize_control_in_prompt"], bool):
            raise InvalidRequest("must be a boolean", field="extra_params.emphasize_control_in_prompt")
        out.kwargs["emphasize_control"] = extra["emphasize_control_in_prompt"]
    return out


# RequestError fields of `world_request`'s transfer / chunk checks -> the request field the client sent.
def transfer_field(name: str) -> str | None:
    if name.startswith("controls."):
        key, _, rest = name[len("controls."):].partition(".")
        return "control_reference" if rest == "video" else f"extra_params.{key}" + (f".{rest}" if rest else "")
    return {"controls": "extra_params", "control_source": "input_reference",
            "control_guidance": "extra_params.control_guidance",
            "control_guidance_interval": "extra_params.control_guidance_interval",
            "emphasize_control": "extra_params.emphasize_control_in_prompt",
            "num_video_frames_per_chunk": "extra_params.num_video_frames_per_chunk",
            "num_conditional_frames": "extra_params.num_conditional_frames"}.get(name)
