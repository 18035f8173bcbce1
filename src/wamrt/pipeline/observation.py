"""The DROID observation contract, in one function that the library (`Policy.infer`, the engine) and every server
surface (openpi websocket, `/v1/policy/infer`, `/v1/videos` policy jobs) run: `check_observation`.

Keys (openpi's DROID names):

    prompt                              required: a non-empty string of at most 4096 characters
    observation/joint_position          required: [7] or [T, 7] finite numbers (the last row is the state)
    observation/gripper_position        required: a scalar, [T] or [T, 1] finite number
    observation/image                   one pre-composed view, or else the RoboArena views:
    observation/wrist_image_left        required without observation/image
    observation/exterior_image_1_left   required without observation/image
    observation/exterior_image_2_left   optional (`OPTIONAL_KEYS`): absent -> black, said in the notes
    action_prefix                       optional: [d, 8] rows already committed, d <= 16 (wamrt.pipeline.prefix)
    action_prefix_mode                  optional: "auto" (default), "clean" or "inpaint"

Images are [H, W, 3] (or [3, H, W], transposed), 2..8192 pixels a side, uint8 or numbers: floats in [0, 1] are
scaled by 255 (openpi's convention), then values are clipped to [0, 255] and truncated to uint8. 0-indexed
exteriors (`observation/exterior_image_0_left`, `_1_`) are renamed to 1-indexed ones. Keys that clients send but
the contract does not use (`UNUSED_KEYS`) are dropped; any other key is dropped with a note that names the
closest known key ("did you mean"), and a missing required key names the misspelling that may stand for it.

A new optional key is one entry of `OPTIONAL_KEYS`: its check, its default (or none) and the note said when the
default is used.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import RequestError
from .noise import droid_state_row
from .prefix import PREFIX_KEY, PREFIX_MODE_KEY, parse_action_prefix

PROMPT = "prompt"
IMAGE = "observation/image"
WRIST = "observation/wrist_image_left"
EXT1, EXT2 = "observation/exterior_image_1_left", "observation/exterior_image_2_left"
EXT0 = "observation/exterior_image_0_left"  # 0-indexed wrappers (DreamZero / AR_droid)
JOINTS, GRIPPER = "observation/joint_position", "observation/gripper_position"
MAX_PROMPT_CHARS = 4096
MAX_IMAGE_SIDE = 8192
# Sent by real clients but not used by this contract: dropped without a note.
UNUSED_KEYS = frozenset({
    "observation/cartesian_position", "observation/eef_pos", "observation/eef_quat",
    "observation/wrist_image_right", "observation/exterior_image_1_right", "observation/exterior_image_2_right",
    "env_id",
})


def check_image(value: Any, key: str) -> np.ndarray:
    """One view -> uint8 [H, W, 3] (see the module docstring), or a RequestError naming `key`."""
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise RequestError(f"not an array ({exc})", field=key) from exc
    if value.dtype.kind not in "uif":
        raise RequestError(f"must be a numeric image, got dtype {value.dtype}", field=key)
    if value.ndim == 3 and value.shape[0] == 3 and value.shape[-1] != 3:
        value = np.transpose(value, (1, 2, 0))
    if value.ndim != 3 or value.shape[-1] != 3 or min(value.shape[:2]) < 2 or max(value.shape[:2]) > MAX_IMAGE_SIDE:
        raise RequestError(f"must be [H, W, 3] (2..{MAX_IMAGE_SIDE} pixels a side), got {tuple(value.shape)}",
                           field=key)
    if value.dtype == np.uint8:
        return np.ascontiguousarray(value)
    if value.dtype.kind == "f":
        if not np.isfinite(value).all():
            raise RequestError("contains NaN or inf", field=key)
        if value.min() >= 0.0 and value.max() <= 1.0:
            value = value * 255.0  # openpi's convert_to_uint8 convention for float images
    return np.clip(value, 0, 255).astype(np.uint8)  # float -> uint8 truncates toward zero, as the server's cast


@dataclass(frozen=True)
class OptionalKey:
    """An observation key a client may leave out. `check(value, key)` -> the value used (or a RequestError naming
    the key); `default(observation)` -> the value used when it is absent (None: stays absent), given the checked
    observation so far; `note` is said in the reply when the default is used."""

    check: Callable[[Any, str], Any]
    default: Callable[[Mapping[str, Any]], Any] | None = None
    note: str = ""


def _black_exterior(obs: Mapping[str, Any]) -> np.ndarray | None:
    # Only the RoboArena views need a second exterior; openpi's DROID example sends one.
    return None if IMAGE in obs else np.zeros_like(obs[EXT1])


def _checked_prefix(value: Any, key: str) -> Any:
    # Shape [d, 8], d <= 16, finite / one of the modes (`parse_action_prefix`); the policy reads it with its
    # contract's width and chunk.
    parse_action_prefix({key: value})
    return value


OPTIONAL_KEYS: dict[str, OptionalKey] = {
    EXT2: OptionalKey(check_image, _black_exterior, "missing: zero-filled (a black second exterior view)"),
    # The rows a moving robot committed while this request is in flight (wamrt.pipeline.prefix): absent = none.
    PREFIX_KEY: OptionalKey(_checked_prefix),
    PREFIX_MODE_KEY: OptionalKey(_checked_prefix),
}
REQUIRED_KEYS = (PROMPT, JOINTS, GRIPPER)
VIEW_KEYS = (IMAGE, WRIST, EXT1)


@dataclass
class CheckedObservation:
    """What `check_observation` returns: the observation the model reads (contract keys only, images uint8
    [H, W, 3], defaults filled in) and what the reply says about it (`ActionChunk.notes`, `metadata.notes`)."""

    observation: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def known_keys(also_known: Iterable[str] = ()) -> list[str]:
    return [*REQUIRED_KEYS, *VIEW_KEYS, *OPTIONAL_KEYS, EXT0, *sorted(UNUSED_KEYS), *also_known]


def _missing(key: str, strays: list[str], message: str = "is missing") -> RequestError:
    """A missing key's error; a stray key that looks like it names the misspelling ("did you mean")."""
    close = difflib.get_close_matches(key, strays, n=1, cutoff=0.8)
    hint = f" (the observation has {close[0]!r}: did you mean {key!r}?)" if close else ""
    return RequestError(message + hint, field=key)


def check_observation(obs: Any, *, also_known: Iterable[str] = ()) -> CheckedObservation:
    """Validate one DROID observation and fill in its defaults (the contract in the module docstring). Raises
    RequestError naming the key. `also_known`: keys the caller reads itself (a server's control keys), neither
    noted nor returned."""
    if not isinstance(obs, Mapping):
        raise RequestError(f"observation must be a mapping, got {type(obs).__name__}")
    msg: dict[str, Any] = {}
    for key, value in obs.items():
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        if not isinstance(key, str):
            raise RequestError(f"observation keys must be strings, got {type(key).__name__}")
        msg[key] = value
    also = frozenset(also_known)
    known = known_keys(also)
    strays = [k for k in msg if k not in known]
    notes = []
    for key in strays:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        notes.append(f"{key!r} is not an observation key: ignored{hint}")

    prompt = msg.get(PROMPT)
    if PROMPT not in msg:
        raise _missing(PROMPT, strays)
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("must be a non-empty string", field=PROMPT)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"longer than {MAX_PROMPT_CHARS} characters", field=PROMPT)
    out: dict[str, Any] = {PROMPT: prompt}

    if EXT0 in msg:  # 0-indexed exteriors: _0 -> _1, _1 -> _2
        second = msg.pop(EXT1, None)
        msg[EXT1] = msg.pop(EXT0)
        if second is not None:
            msg[EXT2] = second
    if IMAGE in msg:
        out[IMAGE] = check_image(msg[IMAGE], IMAGE)
    else:
        missing = [k for k in (WRIST, EXT1) if k not in msg]
        if missing:
            raise _missing(missing[0], strays, f"needs {IMAGE!r} or the wrist and exterior views; missing {missing} "
                                               f"({EXT2!r} is optional)")
        out[WRIST], out[EXT1] = check_image(msg[WRIST], WRIST), check_image(msg[EXT1], EXT1)

    for key in (JOINTS, GRIPPER):
        if key not in msg:
            raise _missing(key, strays)
        out[key] = msg[key]
    droid_state_row(out[JOINTS], out[GRIPPER])  # NaN/inf and shapes: a RequestError naming the key

    for key, spec in OPTIONAL_KEYS.items():
        if key in msg and msg[key] is not None:
            out[key] = spec.check(msg[key], key)
        elif spec.default is not None:
            value = spec.default(out)
            if value is not None:
                out[key] = value
                notes.append(f"{key} {spec.note}")
    return CheckedObservation(out, notes)
