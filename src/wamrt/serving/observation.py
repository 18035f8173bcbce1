"""Decoded request map -> (observation for the policy, control fields), with cheap up-front checks.

Everything here runs on the event loop, so it only looks at keys, shapes, dtypes and small state
vectors; the full validation (and all pixel work) stays in the policy on the engine thread. Rejecting
obvious garbage here keeps it out of batches and answers it without queueing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..pipeline.noise import droid_state_row
from ..pipeline.prefix import PREFIX_KEY, PREFIX_MODE_KEY, parse_action_prefix
from .errors import InvalidRequest, StaleObservation

PROMPT = "prompt"
IMAGE = "observation/image"
WRIST = "observation/wrist_image_left"
EXT1, EXT2 = "observation/exterior_image_1_left", "observation/exterior_image_2_left"
EXT0 = "observation/exterior_image_0_left"  # 0-indexed wrappers (DreamZero / AR_droid)
JOINTS, GRIPPER = "observation/joint_position", "observation/gripper_position"
IMAGE_KEYS = (IMAGE, WRIST, EXT1, EXT2)
# Optional: the rows the robot committed while this request is in flight (wamrt.pipeline.prefix).
PREFIX_KEYS = (PREFIX_KEY, PREFIX_MODE_KEY)
POLICY_KEYS = frozenset({PROMPT, *IMAGE_KEYS, JOINTS, GRIPPER, *PREFIX_KEYS})
# Sent by real clients but not used by this contract: accepted and dropped.
IGNORED_KEYS = frozenset({
    "observation/cartesian_position", "observation/eef_pos", "observation/eef_quat",
    "observation/wrist_image_right", "observation/exterior_image_1_right", "observation/exterior_image_2_right",
    "env_id",
})
CONTROL_KEYS = frozenset({
    "endpoint", "session_id", "seed", "reset", "params", "timestamp", "max_age_ms", "embodiment", "request_id",
})
PARAM_ALIASES = {"num_steps": "steps", "steps": "steps", "num_inference_steps": "steps",
                 "guidance": "guidance", "guidance_scale": "guidance", "shift": "shift", "flow_shift": "shift",
                 "guidance_interval": "guidance_interval"}
PARAM_FLAGS = frozenset({"structured", "return_video"})
MAX_PROMPT_CHARS = 4096


@dataclass
class ParsedRequest:
    observation: dict[str, Any]
    endpoint: str = "infer"
    had_endpoint: bool = False  # RoboArena dialect marker
    session_id: str | None = None
    seed: int | None = None
    reset: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)
    deadline: float | None = None  # time.monotonic() after which the request must not run
    embodiment: str | None = None
    notes: list[str] = field(default_factory=list)


def _str_key(key: Any) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "replace")
    if not isinstance(key, str):
        raise InvalidRequest(f"map keys must be strings, got {type(key).__name__}")
    return key


def parse_request(msg: Any, *, reset_only_ok: bool = True) -> ParsedRequest:
    """Split one decoded message. Raises InvalidRequest / StaleObservation with the offending field."""
    if not isinstance(msg, Mapping):
        raise InvalidRequest(f"request must be a map, got {type(msg).__name__}")
    msg = {_str_key(k): v for k, v in msg.items()}
    unknown = sorted(set(msg) - POLICY_KEYS - IGNORED_KEYS - CONTROL_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown keys {unknown}", field=unknown[0])
    out = ParsedRequest(observation={})
    if "endpoint" in msg:
        out.had_endpoint = True
        endpoint = msg["endpoint"]
        if not isinstance(endpoint, str) or endpoint not in ("infer", "reset"):
            raise InvalidRequest(f"must be 'infer' or 'reset', got {endpoint!r}", field="endpoint")
        out.endpoint = endpoint
    if msg.get("session_id") is not None:
        sid = msg["session_id"]
        if not isinstance(sid, str | int) or isinstance(sid, bool) or len(str(sid)) > 256:
            raise InvalidRequest("must be a string of at most 256 characters", field="session_id")
        out.session_id = str(sid)
    if "reset" in msg:
        out.reset = _flag(msg["reset"], "reset")
    if "embodiment" in msg:
        if not isinstance(msg["embodiment"], str):
            raise InvalidRequest("must be a string", field="embodiment")
        out.embodiment = msg["embodiment"]
    if out.endpoint == "reset":
        return out
    out.seed = _seed(msg.get("seed"))
    out.overrides, out.flags = parse_params(msg.get("params"))
    out.deadline = _deadline(msg.get("timestamp"), msg.get("max_age_ms"))
    out.observation = _observation(msg, out.notes)
    return out


def _flag(value: Any, name: str) -> bool:
    """A boolean control value: bool, 0/1 or a numpy bool/int scalar (an array is refused, not truth-tested)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool) or isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidRequest(f"must be a boolean, got {type(value).__name__}", field=name)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, np.integer):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidRequest(f"must be an integer in [0, 2**63), got {value!r}", field="seed")
    return value


def parse_params(params: Any) -> tuple[dict[str, Any], dict[str, bool]]:
    """`params` map -> (sampler overrides with canonical names, boolean flags)."""
    if params is None:
        return {}, {}
    if not isinstance(params, Mapping):
        raise InvalidRequest("must be a map", field="params")
    overrides: dict[str, Any] = {}
    flags: dict[str, bool] = {}
    for raw_key, value in params.items():
        key = _str_key(raw_key)
        if key in PARAM_FLAGS:
            flags[key] = _flag(value, f"params.{key}")
            continue
        name = PARAM_ALIASES.get(key)
        if name is None:
            raise InvalidRequest(f"unknown parameter {key!r}", field=f"params.{key}")
        overrides[name] = _param_value(name, value)
    return overrides, flags


def _param_value(name: str, value: Any) -> Any:
    where = f"params.{name}"
    if name == "steps":
        if isinstance(value, np.integer):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
            raise InvalidRequest(f"must be an integer in [1, 1000], got {value!r}", field=where)
        return value
    if name == "guidance_interval":
        if value is None:
            return None
        if (not isinstance(value, list | tuple | np.ndarray) or len(value) != 2
                or not all(isinstance(v, int | float | np.number) for v in value)):
            raise InvalidRequest(f"must be [lo, hi] or null, got {value!r}", field=where)
        lo, hi = (int(v) for v in value)
        if lo >= hi:
            raise InvalidRequest(f"must have lo < hi, got {value!r}", field=where)
        return (lo, hi)
    if not isinstance(value, int | float | np.number) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"must be a finite number, got {value!r}", field=where)
    if (name == "shift" and value <= 0) or (name == "guidance" and value < 0):
        raise InvalidRequest(f"out of range: {value!r}", field=where)
    return float(value)


def _deadline(timestamp: Any, max_age_ms: Any) -> float | None:
    """Client capture time (unix seconds) + max age -> a monotonic deadline; already late -> stale."""
    if timestamp is None and max_age_ms is None:
        return None
    for name, value in (("timestamp", timestamp), ("max_age_ms", max_age_ms)):
        if not isinstance(value, int | float | np.number) or isinstance(value, bool) or not math.isfinite(value):
            raise InvalidRequest("must be a finite number (both timestamp and max_age_ms are needed)",
                                 field=name)
    if max_age_ms <= 0:
        raise InvalidRequest("must be > 0", field="max_age_ms")
    age_ms = 1e3 * (time.time() - float(timestamp))
    if age_ms > max_age_ms:
        raise StaleObservation(f"observation is {age_ms:.0f} ms old, max age {max_age_ms} ms", field="timestamp")
    return time.monotonic() + (float(max_age_ms) - age_ms) / 1e3


def _image(value: Any, key: str) -> np.ndarray:
    """Shape/dtype gate for one view; CHW is transposed and float [0, 1] scaled (openpi tolerates both)."""
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except ValueError as exc:
            raise InvalidRequest(f"not an array ({exc})", field=key) from exc
    if value.dtype.kind not in "uif":
        raise InvalidRequest(f"must be a numeric image, got dtype {value.dtype}", field=key)
    if value.ndim == 3 and value.shape[0] == 3 and value.shape[-1] != 3:
        value = np.transpose(value, (1, 2, 0))
    if value.ndim != 3 or value.shape[-1] != 3 or min(value.shape[:2]) < 2 or max(value.shape[:2]) > 8192:
        raise InvalidRequest(f"must be [H, W, 3] (2..8192 pixels a side), got {tuple(value.shape)}", field=key)
    if value.dtype.kind == "f":
        if not np.isfinite(value).all():
            raise InvalidRequest("contains NaN or inf", field=key)
        if value.size and value.min() >= 0.0 and value.max() <= 1.0:
            value = value * 255.0  # openpi's convert_to_uint8 convention for float images
    return value


def _observation(msg: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    prompt = msg.get(PROMPT)
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("is missing or not a non-empty string", field=PROMPT)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"longer than {MAX_PROMPT_CHARS} characters", field=PROMPT)
    obs: dict[str, Any] = {PROMPT: prompt}
    views = dict(msg)
    if EXT0 in views:  # 0-indexed exteriors: _0 -> _1, _1 -> _2
        views[EXT2] = views.pop(EXT1, None)
        views[EXT1] = views.pop(EXT0)
        if views[EXT2] is None:
            del views[EXT2]
    if IMAGE in views:
        obs[IMAGE] = _image(views[IMAGE], IMAGE)
    elif WRIST in views and EXT1 in views:
        obs[WRIST] = _image(views[WRIST], WRIST)
        obs[EXT1] = _image(views[EXT1], EXT1)
        if EXT2 in views:
            obs[EXT2] = _image(views[EXT2], EXT2)
        else:  # openpi's DROID example sends one exterior: pad with black and say so
            obs[EXT2] = np.zeros_like(obs[EXT1])
            notes.append(f"{EXT2} missing: zero-filled")
    else:
        missing = [k for k in (WRIST, EXT1, EXT2) if k not in views]
        raise InvalidRequest(f"needs {IMAGE!r} or the wrist + exterior views; missing {missing}",
                             field=missing[0])
    for key in (JOINTS, GRIPPER):
        if key not in msg:
            raise InvalidRequest("is missing", field=key)
        obs[key] = msg[key]
    for key in PREFIX_KEYS:
        if key in msg:
            obs[key] = msg[key]
    try:
        droid_state_row(obs[JOINTS], obs[GRIPPER])  # NaN/inf and shape checks, tiny arrays
        parse_action_prefix(obs)  # shape, d <= 16, finite, mode
    except ValueError as exc:
        raise InvalidRequest(str(exc), field=getattr(exc, "field", None)) from exc
    return obs
