"""Observation pixels -> the padded canvas the VAE encodes.

The recipes that live here:

* the framework DROID server's (`action_policy_server_robolab` + `ActionTransformPipeline`): compose
  views, resize to 540x640 with truncating bilinear, then reflect-pad to the bucket with no resize;
* diffusers 0.42.1's generic action mode (`VideoProcessor.preprocess_video` followed by
  `Cosmos3OmniPipeline._prepare_action_video_conditioning`) for one image, which first resizes to
  multiples of 16 and so does NOT reproduce the server (540 rows become 528);
* diffusers 0.42.1's world modes: image-to-video covers the output size and centre-crops
  (`_preprocess_conditioning_image`); video-to-video stretches every frame to the output size
  (`VideoProcessor.preprocess_video` with a height and width).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.geometry import VAE_SPATIAL, CanvasGeometry, canvas_geometry

IMAGE_KEY = "observation/image"
WRIST_KEY = "observation/wrist_image_left"
EXTERIOR_KEYS = ("observation/exterior_image_1_left", "observation/exterior_image_2_left")
# Server defaults `_DEFAULT_IMAGE_HEIGHT/WIDTH`: every request canvas is brought to this size.
DROID_CANVAS_HW = (540, 640)


@dataclass(frozen=True)
class PaddedCanvas:
    """A canvas on its bucket: `content` is what the pad starts from, `pixels` the padded canvas, made on first use
    (the engine pads on the GPU instead, inside its VAE encode graph: `FrameEncoder.encode_content_uint8`)."""

    content: np.ndarray  # [content_h, content_w, 3] uint8 (resized if the bucket needed it)
    geometry: CanvasGeometry

    @cached_property
    def pixels(self) -> np.ndarray:
        """[canvas_h, canvas_w, 3] uint8, content at top-left."""
        return pad_canvas(self.content, self.geometry)

    @property
    def image_size(self) -> tuple[int, int, int, int]:
        return self.geometry.image_size


@dataclass(frozen=True)
class DiffusersFrame:
    pixels: torch.Tensor  # [1, 3, canvas_h, canvas_w] float32, nominally [-1, 1] (bicubic may overshoot)
    geometry: CanvasGeometry  # source_h/w = the size after the multiple-of-16 resize


def as_rgb_uint8(value: Any, field: str) -> np.ndarray:
    """Validate one image as [H, W, 3]; non-uint8 numbers are clipped to [0, 255] and truncated."""
    try:
        image = np.asarray(value)
    except Exception as exc:  # ragged nested lists and the like
        raise RequestError(f"not an array ({exc})", field=field) from exc
    if image.ndim != 3 or image.shape[-1] != 3:
        raise RequestError(f"must have shape [H, W, 3], got {tuple(image.shape)}", field=field)
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise RequestError(f"is empty: {tuple(image.shape)}", field=field)
    if image.dtype != np.uint8:
        if image.dtype.kind not in "iuf":
            raise RequestError(
                f"must be a numeric (int/uint/float) image, got dtype {image.dtype}", field=field
            )
        # The server would cast NaN/inf to garbage bytes; refusing is the only safe reading.
        if image.dtype.kind == "f" and not np.isfinite(image).all():
            raise RequestError("contains NaN or inf", field=field)
        image = np.clip(image, 0, 255).astype(np.uint8)  # float -> uint8 truncates toward zero
    return np.ascontiguousarray(image)


def resize_bilinear_trunc(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The server's `_resize_rgb_uint8`: fp32 bilinear (align_corners=False, no antialias), truncating cast."""
    h, w = size
    if h < 1 or w < 1:
        raise RequestError(f"cannot resize to {h}x{w}", field="image")
    if image.shape[:2] == (h, w):
        # Scale 1 with align_corners=False samples exactly the source pixels: the resize is the identity
        # (the usual case: exteriors already at half the wrist size).
        return np.array(image, dtype=np.uint8, copy=True)
    x = torch.tensor(image)  # copy: inputs may be read-only views
    x = x.permute(2, 0, 1).unsqueeze(0).float()  # [1, 3, H, W]
    y = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)  # [1, 3, h, w]
    return np.ascontiguousarray(y.squeeze(0).permute(1, 2, 0).numpy().astype(np.uint8))  # [h, w, 3]


def compose_droid_canvas(obs: Mapping[str, Any], size: tuple[int, int] = DROID_CANVAS_HW) -> np.ndarray:
    """DROID observation -> uint8 [540, 640, 3] canvas, as the framework server builds it.

    `observation/image` wins when present; otherwise the three RoboArena views are stacked as wrist on
    top and [exterior_1 | exterior_2] (each resized to half the wrist size) below.
    """
    if IMAGE_KEY in obs:
        canvas = as_rgb_uint8(obs[IMAGE_KEY], IMAGE_KEY)
    else:
        missing = [k for k in (WRIST_KEY, *EXTERIOR_KEYS) if k not in obs]
        if missing:
            raise RequestError(
                f"observation needs {IMAGE_KEY!r} or all three RoboArena views; missing {missing}",
                field=missing[0],
            )
        wrist = as_rgb_uint8(obs[WRIST_KEY], WRIST_KEY)
        half = (wrist.shape[0] // 2, wrist.shape[1] // 2)
        if min(half) < 1:
            raise RequestError(f"too small to halve: {wrist.shape[:2]}", field=WRIST_KEY)
        if wrist.shape[1] % 2:  # the two half-width exteriors below it would be one column narrower
            raise RequestError(f"width must be even to sit above the two exteriors, got {wrist.shape[1]}",
                               field=WRIST_KEY)
        # The resize runs even when an exterior already has the half size (it is then an exact copy).
        bottom = [resize_bilinear_trunc(as_rgb_uint8(obs[k], k), half) for k in EXTERIOR_KEYS]
        canvas = np.concatenate([wrist, np.concatenate(bottom, axis=1)], axis=0)  # [h + h//2, w, 3]
    if canvas.shape[:2] != tuple(size):
        canvas = resize_bilinear_trunc(canvas, size)
    return canvas


def _resize_bicubic_aa_uint8(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    # torchvision's tensor resize for uint8 (float32 compute, clamp, round). DROID canvases never reach
    # this (scale is 1 at tier 480), so no fixture covers it.
    x = torch.tensor(image).permute(2, 0, 1).unsqueeze(0).float()  # [1, 3, H, W]
    y = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    y = y.clamp(0, 255).round().to(torch.uint8)
    return np.ascontiguousarray(y.squeeze(0).permute(1, 2, 0).numpy())


def pad_to_bucket(canvas: np.ndarray, tier: str | int = "480") -> PaddedCanvas:
    """Framework `VideoResize`: pick the framework bucket, shrink only if needed, pad bottom/right."""
    canvas = as_rgb_uint8(canvas, "canvas")
    geo = canvas_geometry(canvas.shape[0], canvas.shape[1], tier, "framework")
    if geo.needs_resize:
        canvas = _resize_bicubic_aa_uint8(canvas, (geo.content_h, geo.content_w))
    return PaddedCanvas(np.ascontiguousarray(canvas), geo)


def pad_canvas(content: np.ndarray, geo: CanvasGeometry) -> np.ndarray:
    """The bucket's bottom / right pad of a [content_h, content_w, 3] canvas (`geo.pad_mode`)."""
    mode = geo.pad_mode
    if mode == "reflect":
        return reflect_pad(content, geo.pad_bottom, geo.pad_right)
    if mode != "none":
        return np.pad(content, ((0, geo.pad_bottom), (0, geo.pad_right), (0, 0)), mode=mode)
    return content


def pad_unit_pixels(x: torch.Tensor, geo: CanvasGeometry) -> torch.Tensor:
    """`pad_canvas` on [B, 3, content_h, content_w] float pixels (any device): the same values, since a pad only
    moves pixels (torch's reflect pad, like numpy's, does not repeat the edge; numpy's "edge" is "replicate")."""
    mode = geo.pad_mode
    if mode == "none":
        return x
    return F.pad(x, (0, geo.pad_right, 0, geo.pad_bottom), mode="reflect" if mode == "reflect" else "replicate")


def reflect_pad(image: np.ndarray, bottom: int, right: int) -> np.ndarray:
    """`np.pad(image, ((0, bottom), (0, right), (0, 0)), mode="reflect")` (a mirror that does not repeat the edge
    row / column, like torch's reflect pad) for pads smaller than the image, as three slice copies: np.pad's
    general path took 0.55 of the ~1 ms of host work before a DROID request's VAE encode, this 0.3 ms (540 x 640 ->
    544 x 736, one CPU core). Pixels move as whole items of all their channels: a column flip over the separate
    channel bytes alone took 0.6 ms."""
    h, w = image.shape[:2]
    if not (0 <= bottom < h and 0 <= right < w):
        raise ValueError(f"reflect pads ({bottom}, {right}) must be smaller than the image ({h}, {w})")
    out = np.empty((h + bottom, w + right, *image.shape[2:]), dtype=image.dtype)
    out[:h, :w] = image
    out[h:, :w] = image[h - 1 - bottom : h - 1][::-1]  # rows h-2, h-3, ...
    pixels = out.reshape(h + bottom, w + right, -1)
    pixels = pixels.view(np.dtype((np.void, pixels.shape[2] * pixels.itemsize)))[..., 0]  # [H, W] of whole pixels
    pixels[:, w:] = pixels[:, w - 1 - right : w - 1][:, ::-1]  # over the padded height: np.pad pads axis after axis
    return out


def vae_input(pixels: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [1, 3, 1, H, W] in [-1, 1] (x / 127.5 - 1, as the framework does)."""
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float()  # [3, H, W]
    return (x / 127.5 - 1.0)[None, :, None]  # [1, 3, 1, H, W]


def diffusers_preprocess_image(image: Image.Image | np.ndarray, tier: str | int = 480) -> DiffusersFrame:
    """One conditioning frame exactly as diffusers' generic action mode prepares a single PIL image.

    A uint8 array is routed through PIL on purpose: diffusers' own numpy path skips the /255 scaling
    and uses nearest resizing, which is a bug rather than a recipe.
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise RequestError(f"must be uint8 [H, W, 3], got {image.dtype} {image.shape}", field="image")
        image = Image.fromarray(image)  # uint8 [H, W, 3] -> mode RGB
    if not isinstance(image, Image.Image):
        raise RequestError(f"must be a PIL image or uint8 array, got {type(image).__name__}", field="image")
    if image.mode != "RGB":
        raise RequestError(f"PIL image must be mode RGB, got {image.mode}", field="image")

    # Step 1 (VideoProcessor): floor both sides to a multiple of 16, PIL bilinear, [0,1] -> [-1,1].
    w16 = image.width - image.width % VAE_SPATIAL
    h16 = image.height - image.height % VAE_SPATIAL
    if w16 == 0 or h16 == 0:
        raise RequestError(f"must be at least 16x16, got {image.height}x{image.width}", field="image")
    x = diffusers_resize_frame(image, h16, w16)

    # Step 2 (_prepare_action_video_conditioning): bin, shrink-only bicubic, pad bottom/right.
    geo = canvas_geometry(h16, w16, tier, "diffusers")
    if geo.needs_resize:
        x = F.interpolate(
            x, size=(geo.content_h, geo.content_w), mode="bicubic", align_corners=False, antialias=True
        )
    if geo.pad_mode != "none":
        torch_mode = "replicate" if geo.pad_mode == "edge" else "reflect"
        x = F.pad(x, (0, geo.pad_right, 0, geo.pad_bottom), mode=torch_mode)
    return DiffusersFrame(x.contiguous(), geo)


def diffusers_resize_frame(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """`VideoProcessor.preprocess_video` of one RGB frame at a given size: PIL bilinear stretch (aspect
    not kept), [0, 255] -> [-1, 1] -> float32 [1, 3, height, width]."""
    resized = image.resize((width, height), resample=Image.Resampling.BILINEAR, reducing_gap=None)
    x = torch.from_numpy(np.array(resized).astype(np.float32) / 255.0).permute(2, 0, 1)[None]  # [1, 3, h, w]
    return 2.0 * x - 1.0


def diffusers_cover_crop(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """diffusers' image-to-video conditioning frame: scale to cover (height, width) keeping the aspect,
    centre-crop, round to whole pixel values -> float32 [1, 3, height, width] in [-1, 1]."""
    x = torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1)[None].to(torch.float32)  # 0..255
    src_h, src_w = x.shape[-2:]
    scale = max(width / src_w, height / src_h)  # may upscale, unlike the action canvas
    cover_h, cover_w = math.ceil(scale * src_h), math.ceil(scale * src_w)
    x = F.interpolate(x, size=(cover_h, cover_w), mode="bilinear", align_corners=False, antialias=True)
    # Python's round() (half to even) places the crop, as in the reference.
    top, left = round((cover_h - height) / 2), round((cover_w - width) / 2)
    x = x[:, :, top : top + height, left : left + width]
    return x.round().clamp(0, 255) / 127.5 - 1.0
