"""Checks of request fields shared by the task contracts: numbers, images, frame lists.

Each check returns the value in the one form the pipeline works with (a Python number, an RGB PIL
image, a tuple of them) or raises `RequestError` naming the field.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from .errors import RequestError

ImageInput = Image.Image | np.ndarray  # PIL RGB or uint8 [H, W, 3]
VideoInput = Sequence[ImageInput] | np.ndarray  # frames, or uint8 [T, H, W, 3]


def finite_number(value: Any, field: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RequestError(f"must be a finite number, got {value!r}", field=field)
    if positive and value <= 0:
        raise RequestError(f"must be > 0, got {value!r}", field=field)
    return float(value)


def positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RequestError(f"must be an integer >= 1, got {value!r}", field=field)
    return int(value)


def text_field(value: Any, field: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        expected = "a string or None" if optional else "a string"
        raise RequestError(f"must be {expected}, got {type(value).__name__}", field=field)
    return value


def bool_field(value: Any, field: str) -> bool:
    # A truthy string such as "false" must not switch a feature on.
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"must be True or False, got {value!r}", field=field)
    return bool(value)


def rgb_image(frame: Any, field: str) -> Image.Image:
    """PIL RGB or uint8 [H, W, 3] -> PIL RGB (uint8 arrays go through PIL so both inputs are one path)."""
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
            raise RequestError(f"must be uint8 [H, W, 3], got {frame.dtype} {frame.shape}", field=field)
        return Image.fromarray(np.ascontiguousarray(frame))
    if not isinstance(frame, Image.Image):
        raise RequestError(f"must be a PIL image or a uint8 array, got {type(frame).__name__}", field=field)
    if frame.mode != "RGB":
        raise RequestError(f"PIL image must be mode RGB, got {frame.mode}", field=field)
    return frame


def rgb_frames(video: Any, field: str = "video") -> tuple[Image.Image, ...]:
    """A non-empty list of frames or a uint8 [T, H, W, 3] array -> RGB PIL frames."""
    if isinstance(video, np.ndarray):
        if video.ndim != 4:
            raise RequestError(f"array video must be uint8 [T, H, W, 3], got {video.shape}", field=field)
        video = list(video)
    if not isinstance(video, Sequence) or isinstance(video, (str, bytes)) or len(video) == 0:
        raise RequestError("must be a non-empty list of frames or a uint8 [T, H, W, 3] array", field=field)
    return tuple(rgb_image(f, f"{field}[{i}]") for i, f in enumerate(video))
