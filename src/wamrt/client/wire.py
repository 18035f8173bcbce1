"""The openpi numpy-over-msgpack wire format, written from the field list (numpy + msgpack only).

Outbound arrays use openpi-client's markers (`__ndarray__` / `__npgeneric__`), which every known client
decodes. Inbound we accept all three numpy dialects seen in the wild (../shared/docs/protocols.md §2.4):

* openpi-client:  {b"__ndarray__": True, b"data", b"dtype", b"shape"}, {b"__npgeneric__": True, ...}
* msgpack-numpy:  {b"nd": True, b"type", b"kind", b"shape", b"data"}, scalars {b"nd": False, ...}
* vLLM native:    the same fields as msgpack-numpy under str keys.

Decoding never trusts the peer: dtypes are limited to bool/int/uint/float, the byte count must match
shape x itemsize, and the result is a read-only view over the received buffer (no copy, no pickle).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

MAX_DIMS = 8
MAX_IMAGE_PIXELS = 3840 * 2160  # one decoded PNG/JPEG, read from its header before decoding (4K UHD)
# Tuples are sequences on the wire; numbers stay numbers. Anything else is refused, never pickled.
_ALLOWED_KINDS = "biuf"


class WireError(ValueError):
    """A payload that cannot be decoded into an observation (malformed msgpack, bad array marker...)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message if field is None else f"{field}: {message}")
        self.field = field


def _get(obj: Mapping[Any, Any], name: str) -> Any:
    # Each dialect may arrive with bytes keys (use_bin_type packers) or str keys.
    if name in obj:
        return obj[name]
    return obj.get(name.encode())


def _has(obj: Mapping[Any, Any], name: str) -> bool:
    return name in obj or name.encode() in obj


def _dtype(value: Any) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise WireError(f"array dtype must be a string, got {type(value).__name__}")
    try:
        dt = np.dtype(value)
    except TypeError as exc:
        raise WireError(f"unknown array dtype {value!r}") from exc
    if dt.kind not in _ALLOWED_KINDS or dt.hasobject or dt.fields is not None:
        raise WireError(f"array dtype {dt} is not allowed (bool, int, uint and float only)")
    return dt


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_DIMS:
        raise WireError(f"array shape must be a list of at most {MAX_DIMS} ints, got {value!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise WireError(f"array shape must hold non-negative ints, got {value!r}")
    return tuple(value)


def _array(data: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"array data must be bytes, got {type(data).__name__}")
    need = math.prod(shape) * dtype.itemsize
    if len(data) != need:
        raise WireError(f"array data has {len(data)} bytes, shape {shape} x {dtype} needs {need}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _scalar(data: Any, dtype: np.dtype) -> np.generic:
    if isinstance(data, bytes | bytearray):  # msgpack-numpy packs scalars as their raw bytes
        if len(data) != dtype.itemsize:
            raise WireError(f"scalar data has {len(data)} bytes, {dtype} needs {dtype.itemsize}")
        return np.frombuffer(data, dtype=dtype)[0]
    if isinstance(data, bool | int | float):
        try:
            return dtype.type(data)
        except (OverflowError, ValueError) as exc:
            raise WireError(f"scalar {data!r} does not fit {dtype}") from exc
    raise WireError(f"scalar data must be a number or bytes, got {type(data).__name__}")


def decode_hook(obj: dict[Any, Any]) -> Any:
    """msgpack `object_hook`: turn any of the three numpy markers into numpy values."""
    if _has(obj, "__ndarray__"):
        return _array(_get(obj, "data"), _dtype(_get(obj, "dtype")), _shape(_get(obj, "shape")))
    if _has(obj, "__npgeneric__"):
        return _scalar(_get(obj, "data"), _dtype(_get(obj, "dtype")))
    if _has(obj, "nd") and _has(obj, "type") and _has(obj, "data"):
        kind = _get(obj, "kind")
        if kind not in (None, b"", ""):
            raise WireError(f"array kind {kind!r} (structured/object) is not allowed")
        dtype = _dtype(_get(obj, "type"))
        if _get(obj, "nd") is True:
            return _array(_get(obj, "data"), dtype, _shape(_get(obj, "shape")))
        return _scalar(_get(obj, "data"), dtype)
    return obj


def _encode_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic):
        if obj.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"cannot send dtype {obj.dtype}")
        if isinstance(obj, np.ndarray):
            arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # keeps 0-d shapes
            return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": arr.shape}
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot msgpack {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """msgpack with openpi numpy markers (what openpi-client, RoboLab and vLLM-Omni's clients decode)."""
    return msgpack.packb(obj, default=_encode_default, use_bin_type=True)


def unpackb(data: bytes, *, max_bytes: int | None = None) -> Any:
    """Decode one frame; every failure is a WireError (never msgpack's own exception zoo)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        # raw=False: str stays str; strict_map_key=False: openpi's markers use bytes keys.
        return msgpack.unpackb(data, object_hook=decode_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError...
        raise WireError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc


# --- JSON ------------------------------------------------------------------------------------------

def json_array(value: Any, field: str, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """One JSON value of an observation -> numpy where it is an array.

    `{"b64": ..., "dtype": "uint8", "shape": [H, W, 3]}` is raw bytes when the size matches the shape,
    else an encoded PNG/JPEG (of at most `max_pixels`); nested lists become arrays; strings and numbers pass
    through.
    """
    if isinstance(value, dict) and "b64" in value:
        try:
            raw = base64.b64decode(value["b64"], validate=True)
        except (ValueError, TypeError) as exc:
            raise WireError(f"bad base64 ({exc})", field=field) from exc
        if "shape" in value:
            dtype = _dtype(value.get("dtype", "uint8"))
            shape = _shape(value["shape"])
            if len(raw) == math.prod(shape) * dtype.itemsize:
                return _array(raw, dtype, shape)
        return decode_image(raw, field, max_pixels)
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError as exc:
            raise WireError(f"ragged nested list ({exc})", field=field) from exc
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise WireError(f"must be numbers, got {arr.dtype}", field=field)
        return arr
    return value


def decode_image(raw: bytes, field: str, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """PNG/JPEG bytes -> uint8 RGB [H, W, 3]. The size comes from the header (`Image.open` reads nothing
    more) and is checked against `max_pixels` before any pixel is decoded."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise WireError(f"{w}x{h} = {w * h} pixels is over the {max_pixels}-pixel limit", field=field)
            return np.asarray(im.convert("RGB"))
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001  # UnidentifiedImageError, DecompressionBombError, truncated data...
        # Not Pillow's text: it names the BytesIO by its heap address.
        raise WireError(f"not a PNG/JPEG image and not raw bytes of the given shape ({type(exc).__name__})",
                        field=field) from None


def to_jsonable(obj: Any) -> Any:
    """numpy values -> nested lists / numbers for JSON replies."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj
