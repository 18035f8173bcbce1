"""Decoded request map -> (observation for the policy, control fields), with cheap up-front checks.

The observation goes through `wamrt.pipeline.observation.check_observation`, the contract `Policy.infer` runs
too (same keys, same defaults, same errors), so a bad observation is answered without queueing; the pixel work
(canvas, resizes) stays in the policy on the engine thread. Control keys (`CONTROL_KEYS`) are read here. It runs
in the parse pool (`Service.offload`), off the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..pipeline.errors import RequestError
from ..pipeline.observation import EXT0, EXT1, EXT2, IMAGE, WRIST, check_observation
from .errors import InvalidRequest, StaleObservation
from .limits import DEFAULT_LIMITS, SAMPLER_RANGES, Limits

CONTROL_KEYS = frozenset({
    "endpoint", "session_id", "seed", "reset", "params", "timestamp", "max_age_ms", "embodiment", "request_id",
})
PARAM_ALIASES = {"num_steps": "steps", "steps": "steps", "num_inference_steps": "steps",
                 "guidance": "guidance", "guidance_scale": "guidance", "shift": "shift", "flow_shift": "shift",
                 "guidance_interval": "guidance_interval"}
PARAM_FLAGS = frozenset({"structured", "return_video"})
IMAGE_KEYS = (IMAGE, WRIST, EXT0, EXT1, EXT2)
# A capture time this far ahead of the server's clock is refused: it would push the deadline past max_age_ms.
MAX_CLOCK_SKEW_MS = 1000.0
MAX_AGE_MS = 3_600_000.0  # an hour; a larger max_age_ms bounds nothing


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


def parse_request(msg: Any, *, reset_only_ok: bool = True, limits: Limits = DEFAULT_LIMITS) -> ParsedRequest:
    """Split one decoded message. Raises InvalidRequest / StaleObservation with the offending field. The prompt's
    token count and the step bound are the service's (`Service.check_policy`): they need the served model."""
    if not isinstance(msg, Mapping):
        raise InvalidRequest(f"request must be a map, got {type(msg).__name__}")
    msg = {_str_key(k): v for k, v in msg.items()}
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
    out.observation = _observation(msg, out.notes, limits.image_pixels)
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
        lo_ok, hi_ok = SAMPLER_RANGES["guidance_interval"]
        if (not isinstance(value, list | tuple | np.ndarray) or len(value) != 2
                or not all(isinstance(v, int | float | np.number) and not isinstance(v, bool)
                           and math.isfinite(v) and float(v).is_integer() and lo_ok <= v <= hi_ok for v in value)):
            raise InvalidRequest(f"must be [lo, hi] of integers in [{lo_ok}, {hi_ok}] or null", field=where)
        lo, hi = (int(v) for v in value)
        if lo >= hi:
            raise InvalidRequest(f"must have lo < hi, got [{lo}, {hi}]", field=where)
        return (lo, hi)
    if not isinstance(value, int | float | np.number) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequest(f"must be a finite number, got {type(value).__name__}", field=where)
    lo_ok, hi_ok = SAMPLER_RANGES[name]
    if not lo_ok <= value <= hi_ok:
        raise InvalidRequest(f"must be in [{lo_ok:g}, {hi_ok:g}], got {float(value):g}", field=where)
    return float(value)


def _deadline(timestamp: Any, max_age_ms: Any) -> float | None:
    """Client capture time (unix seconds) + max age -> a monotonic deadline; already late -> stale."""
    if timestamp is None and max_age_ms is None:
        return None
    for name, value in (("timestamp", timestamp), ("max_age_ms", max_age_ms)):
        if not isinstance(value, int | float | np.number) or isinstance(value, bool) or not math.isfinite(value):
            raise InvalidRequest("must be a finite number (both timestamp and max_age_ms are needed)",
                                 field=name)
    if not 0 < max_age_ms <= MAX_AGE_MS:
        raise InvalidRequest(f"must be in (0, {MAX_AGE_MS:.0f}] ms", field="max_age_ms")
    age_ms = 1e3 * (time.time() - float(timestamp))
    if age_ms < -MAX_CLOCK_SKEW_MS:
        raise InvalidRequest(f"is {-age_ms:.0f} ms in the future by this server's clock (more than "
                             f"{MAX_CLOCK_SKEW_MS:.0f} ms: are the clocks synchronised?)", field="timestamp")
    if age_ms > max_age_ms:
        raise StaleObservation(f"observation is {age_ms:.0f} ms old, max age {max_age_ms} ms", field="timestamp")
    # A capture time slightly ahead (clock skew) counts as age 0: never more than max_age_ms from now.
    return time.monotonic() + (float(max_age_ms) - max(age_ms, 0.0)) / 1e3


def _observation(msg: Mapping[str, Any], notes: list[str], max_pixels: int) -> dict[str, Any]:
    """The shared contract (`check_observation`), after this server's pixel bound (--max-image-pixels) on every
    view, read from its shape before any conversion allocates; its RequestError becomes the surfaces'
    InvalidRequest."""
    for key in IMAGE_KEYS:
        value = msg.get(key)
        if isinstance(value, np.ndarray) and value.ndim == 3:
            chw = value.shape[0] == 3 and value.shape[-1] != 3
            h, w = value.shape[1:] if chw else value.shape[:2]
            if h * w > max_pixels:
                raise InvalidRequest(f"{w}x{h} is over the {max_pixels}-pixel limit (--max-image-pixels)", field=key)
    try:
        checked = check_observation(msg, also_known=CONTROL_KEYS)
    except RequestError as exc:
        raise InvalidRequest(exc.message, field=exc.field) from exc
    notes.extend(checked.notes)
    return checked.observation
