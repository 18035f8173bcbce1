"""Video transfer controls: the hints (edge, blur, depth, segmentation), their options, and their videos.

A control is an RGB video on the output's own frame grid. Edge and blur are computed here from a source video with
OpenCV, as NVIDIA's cosmos-framework and vLLM-Omni compute them: the source is first scaled to cover the output
size and centre-cropped, then
* edge: Canny on each uint8 RGB frame, thresholds by preset (`EDGE_PRESETS`), the map repeated on 3 channels;
* blur: area downscale by a preset factor, one bilateral filter (diameter 30, sigma colour 150, sigma space 100 at
  a 720-pixel longest side, scaled to the frame's longest side, the diameter odd), linear upscale, then a cubic
  down-up resize by a second preset factor (`BLUR_PRESETS`).
Depth and segmentation videos come from the user; they (and precomputed edge / blur videos) are scaled to cover
the output and centre-cropped the same way. A control shorter than the clip is extended by mirroring it back and
forth in time (`mirror_pad`), as both peers do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .errors import RequestError

HINT_KEYS: tuple[str, ...] = ("edge", "blur", "depth", "seg")  # the order controls take in the sequence
COMPUTED_HINTS = ("edge", "blur")  # computed from a source video when no control video is given
EDGE_PRESETS: dict[str, tuple[int, int]] = {
    "very_low": (20, 50), "low": (50, 100), "medium": (100, 200), "high": (200, 300), "very_high": (300, 400)}
# preset -> (area downscale before the bilateral filter, cubic down-up factor after it)
BLUR_PRESETS: dict[str, tuple[int, int]] = {
    "none": (1, 1), "very_low": (1, 4), "low": (4, 4), "medium": (2, 10), "high": (1, 16), "very_high": (4, 16)}
BILATERAL_D, BILATERAL_SIGMA_COLOR, BILATERAL_SIGMA_SPACE, BILATERAL_REFERENCE_SIDE = 30, 150.0, 100.0, 720
# Single-hint recipe defaults (cosmos-framework / vLLM-Omni): guidance 3, flow shift 10, control guidance by hint.
TRANSFER_GUIDANCE, TRANSFER_SHIFT = 3.0, 10.0
DEFAULT_CONTROL_GUIDANCE = {"edge": 1.5, "blur": 1.5, "depth": 1.5, "seg": 2.0}
# The checkpoints' transfer system prompt, and the directive the peers append to the prompt by default.
SYSTEM_PROMPT_TRANSFER = ("You are a helpful assistant that generates images or videos following the user's "
                          "instructions and control signals (edge maps, blur, depth, or segmentation).")


def control_directive(keys: Sequence[str]) -> str:
    names = ", ".join(keys)
    return (f"Follow the {names} control video precisely: shape, contour, silhouette, position, and motion of every "
            f"visible structure must align with the {names} signal at every frame.")


@dataclass(frozen=True, eq=False)
class ControlHint:
    """One control of a transfer request: its hint, its weight in the target's attention, the edge threshold or
    blur strength preset, and its video (uint8 [T, H, W, 3], any size) when given rather than computed."""

    key: str
    weight: float = 1.0
    preset: str = "medium"
    video: np.ndarray | None = None

    @property
    def computed(self) -> bool:
        return self.video is None


def video_frames(video: Any, field: str) -> np.ndarray:
    """A uint8 [T, H, W, 3] array or a non-empty list of uint8 [H, W, 3] frames / PIL images -> uint8 [T, H, W, 3]."""
    if not isinstance(video, np.ndarray):
        if isinstance(video, (str, bytes)) or not isinstance(video, Sequence) or not video:
            raise RequestError("must be a uint8 [T, H, W, 3] array or a non-empty list of RGB frames", field=field)
        try:
            video = np.stack([np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in video])
        except ValueError as exc:
            raise RequestError(f"frames differ in size ({exc})", field=field) from exc
    if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or min(video.shape[:3]) < 1:
        raise RequestError(f"must be uint8 [T, H, W, 3], got {video.dtype} {video.shape}", field=field)
    return video


def control_hints(controls: Mapping[str, Any]) -> tuple[ControlHint, ...]:
    """`{hint: True | options}` -> the hints in sequence order (`HINT_KEYS`), RequestError naming the field
    `controls.<hint>[.<option>]` otherwise. Options: `control_weight` (>= 0, the weights' sum > 0),
    `preset_edge_threshold` (edge) / `preset_blur_strength` (blur), `video` (the control video itself)."""
    if not isinstance(controls, Mapping) or not controls:
        raise RequestError(f"must map hints ({', '.join(HINT_KEYS)}) to True or their options", field="controls")
    hints = []
    for key in controls:
        if key not in HINT_KEYS:
            raise RequestError(f"unknown hint {key!r}; known: {', '.join(HINT_KEYS)}", field="controls")
    for key in HINT_KEYS:
        if key not in controls:
            continue
        field = f"controls.{key}"
        spec = controls[key]
        if spec is True:
            spec = {}
        if not isinstance(spec, Mapping):
            raise RequestError(f"must be true or an object of options, got {type(spec).__name__}", field=field)
        preset_name = {"edge": "preset_edge_threshold", "blur": "preset_blur_strength"}.get(key)
        allowed = {"control_weight", "video", *([preset_name] if preset_name else [])}
        for name in spec:
            if name not in allowed:
                raise RequestError(f"unknown option {name!r}; known: {', '.join(sorted(allowed))}", field=field)
        weight = spec.get("control_weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) \
                or weight < 0:
            raise RequestError(f"must be a finite number >= 0, got {weight!r}", field=f"{field}.control_weight")
        preset = spec.get(preset_name, "medium") if preset_name else "medium"
        presets = EDGE_PRESETS if key == "edge" else BLUR_PRESETS
        if preset_name and preset not in presets:
            raise RequestError(f"must be one of {list(presets)}, got {preset!r}", field=f"{field}.{preset_name}")
        video = spec.get("video")
        if video is None and key not in COMPUTED_HINTS:
            raise RequestError(f"a {key} control is not computed here: give its video", field=f"{field}.video")
        hints.append(ControlHint(key, float(weight), preset,
                                 None if video is None else video_frames(video, f"{field}.video")))
    if sum(h.weight for h in hints) <= 0:
        raise RequestError("the control weights must not all be 0", field=f"controls.{hints[0].key}.control_weight")
    return tuple(hints)


def normalized_weights(hints: Sequence[ControlHint]) -> list[float]:
    total = sum(h.weight for h in hints)
    return [h.weight / total for h in hints]


# --------------------------------------------------------------------------------------------------
# Pixels


def cv2_module():
    try:
        import cv2
    except ImportError as exc:
        raise RequestError("edge and blur controls need OpenCV: pip install 'wamrt[world]' "
                           "(opencv-python-headless)", field="controls") from exc
    return cv2


def cover_crop_video(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, 3] -> uint8 [T, height, width, 3]: scaled (antialiased bilinear) to cover the output, keeping
    the aspect, centre-cropped, rounded; the resize of `canvas.diffusers_cover_crop` (image -> video's first frame),
    which is also vLLM-Omni's for controls."""
    t, src_h, src_w, _ = frames.shape
    scale = max(width / src_w, height / src_h)
    cover_h, cover_w = math.ceil(scale * src_h), math.ceil(scale * src_w)
    top, left = round((cover_h - height) / 2), round((cover_w - width) / 2)
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for s in range(0, t, 16):  # a few frames at a time: a float copy of a long 1080p video would be gigabytes
        x = torch.from_numpy(frames[s:s + 16]).permute(0, 3, 1, 2).float()
        if (cover_h, cover_w) != (src_h, src_w):
            x = F.interpolate(x, size=(cover_h, cover_w), mode="bilinear", align_corners=False, antialias=True)
        x = x[:, :, top:top + height, left:left + width].round().clamp(0, 255)
        out[s:s + 16] = x.to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return out


def mirror_pad(frames: np.ndarray, count: int) -> np.ndarray:
    """The video extended to `count` frames as cosmos-framework and vLLM-Omni extend a short control: append the
    video so far played backwards (its last frame twice at the turn), repeatedly; cut to `count`."""
    index = list(range(min(len(frames), count)))
    while len(index) < count:
        if len(index) == 1:
            index += index * (count - 1)
            break
        index += index[::-1][: min(len(index) - 1, count - len(index))]
    return frames[index]


def edge_map(frames: np.ndarray, preset: str = "medium") -> np.ndarray:
    """uint8 [T, H, W, 3] -> Canny edges of each frame, uint8 [T, H, W, 3] (0 or 255, the same on every channel)."""
    cv2 = cv2_module()
    low, high = EDGE_PRESETS[preset]
    edges = np.stack([cv2.Canny(np.ascontiguousarray(f), low, high) for f in frames])
    return np.repeat(edges[..., None], 3, axis=-1)


def _bilateral_params(height: int, width: int) -> tuple[int, float, float]:
    scale = max(height, width) / BILATERAL_REFERENCE_SIDE
    d = max(1, round(BILATERAL_D * scale))
    return d + 1 - d % 2, max(1.0, BILATERAL_SIGMA_COLOR * scale), max(1.0, BILATERAL_SIGMA_SPACE * scale)


def blur_map(frames: np.ndarray, preset: str = "medium") -> np.ndarray:
    """uint8 [T, H, W, 3] -> the blur control of each frame, uint8 [T, H, W, 3]."""
    if preset == "none":
        return frames.copy()
    cv2 = cv2_module()
    pre, downup = BLUR_PRESETS[preset]
    _, h, w, _ = frames.shape
    out = np.empty_like(frames)
    for i, frame in enumerate(frames):
        x = np.ascontiguousarray(frame)
        if pre > 1:
            x = cv2.resize(x, (max(1, w // pre), max(1, h // pre)), interpolation=cv2.INTER_AREA)
        x = cv2.bilateralFilter(x, *_bilateral_params(*x.shape[:2]))
        if pre > 1:
            x = cv2.resize(x, (w, h), interpolation=cv2.INTER_LINEAR)
        if downup > 1:
            x = cv2.resize(x, (max(1, w // downup), max(1, h // downup)), interpolation=cv2.INTER_CUBIC)
            x = cv2.resize(x, (w, h), interpolation=cv2.INTER_CUBIC)
        out[i] = x
    return out


def control_video(hint: ControlHint, source: np.ndarray | None, height: int, width: int, frames: int) -> np.ndarray:
    """The control's video for an output of `frames` frames at height x width: uint8 [frames, height, width, 3]."""
    given = hint.video if hint.video is not None else source
    if given is None:
        raise RequestError(f"the {hint.key} control needs a source video to be computed from (or its own video)",
                           field="control_source")
    pixels = cover_crop_video(given[:frames], height, width)
    if hint.computed:
        pixels = edge_map(pixels, hint.preset) if hint.key == "edge" else blur_map(pixels, hint.preset)
    return mirror_pad(pixels, frames)
