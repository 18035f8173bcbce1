"""Optional action / state normalization of a checkpoint (`wamrt.json` key `action_normalization`).

The released DROID checkpoints use none: the model reads the raw state row and emits raw joint targets,
and a contract without this object stays bit-exact to NVIDIA's server. A policy trained here may store
per-dimension statistics instead, because raw radians are a poor target for rectified flow: the joints
spread 0.08-0.5 rad while the sampler's noise has unit scale, so a 4-step sample lands a few control steps
of motion off (issue 12). Everything below is in *model space* (gripper already flipped as the DROID
contract flips it):

  state row in:  s_model = (s - state_mean) / state_std
  chunk in:      a_model[k] = (a[k] - s * relative - action_mean[k]) / action_std[k]   (k = chunk row)
  chunk out:     a[k] = a_model[k] * action_std[k] + action_mean[k] + s * relative

`relative` marks the columns predicted as an offset from the current state (the 7 joints in the recipe of
`wamrt.train`; the gripper stays absolute). Per-row statistics give the near rows, the ones a robot
executes first, their own scale: their offsets are ~10x smaller than those 2 s ahead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..model.checkpoint import CheckpointError

KEY = "action_normalization"
MIN_STD = 1e-3  # a dimension that never moves keeps unit-ish scale instead of dividing by ~0


@dataclass(frozen=True)
class ActionNormalization:
    """Frozen (and hashable: the engine keys its CUDA graphs on the contract that holds it)."""

    state_mean: tuple[float, ...]  # [raw_dim]
    state_std: tuple[float, ...]
    action_mean: tuple[tuple[float, ...], ...]  # [chunk][raw_dim]
    action_std: tuple[tuple[float, ...], ...]
    relative: tuple[bool, ...]  # [raw_dim]

    @property
    def raw_dim(self) -> int:
        return len(self.state_mean)

    @property
    def chunk(self) -> int:
        return len(self.action_mean)

    # ---- arrays ------------------------------------------------------------------------------------
    @cached_property
    def _arrays(self) -> dict[str, np.ndarray]:  # built once: state_in / actions_out run on every request
        return {"state_mean": np.asarray(self.state_mean, np.float32),
                "state_std": np.asarray(self.state_std, np.float32),
                "action_mean": np.asarray(self.action_mean, np.float32),
                "action_std": np.asarray(self.action_std, np.float32),
                "relative": np.asarray(self.relative, np.float32)}

    def arrays(self) -> dict[str, np.ndarray]:
        """The statistics as float32 arrays (copies: the cached ones are shared by every request)."""
        return {k: v.copy() for k, v in self._arrays.items()}

    def state_in(self, state: np.ndarray) -> np.ndarray:
        """Raw model-space state row [raw_dim] (or [..., raw_dim]) -> normalized, float32."""
        a = self._arrays
        return ((np.asarray(state, np.float32) - a["state_mean"]) / a["state_std"]).astype(np.float32)

    def actions_in(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Raw model-space chunk [chunk, raw_dim] and the raw state row it starts from -> normalized."""
        return self.rows_in(chunk, state)

    def rows_in(self, rows: np.ndarray, state: np.ndarray) -> np.ndarray:
        """The first d chunk rows [..., d, raw_dim] (a request's committed prefix, or the whole chunk) -> normalized
        with the statistics of chunk rows 0..d-1."""
        a, d = self._arrays, np.shape(rows)[-2]
        base = np.asarray(state, np.float32)[..., None, :] * a["relative"]
        return ((np.asarray(rows, np.float32) - base - a["action_mean"][:d]) / a["action_std"][:d]).astype(np.float32)

    def actions_out(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Inverse of `actions_in`: the model's normalized chunk -> raw model-space rows, float32."""
        a = self._arrays
        base = np.asarray(state, np.float32)[..., None, :] * a["relative"]
        return (np.asarray(chunk, np.float32) * a["action_std"] + a["action_mean"] + base).astype(np.float32)

    # ---- fitting -----------------------------------------------------------------------------------
    @classmethod
    def fit(cls, states: np.ndarray, chunks: np.ndarray, relative: tuple[bool, ...]) -> ActionNormalization:
        """Statistics of model-space state rows [N, D] and the chunks that follow them [N, chunk, D]."""
        states = np.asarray(states, np.float64)
        chunks = np.asarray(chunks, np.float64)
        if states.ndim != 2 or chunks.ndim != 3 or chunks.shape[0] != states.shape[0] \
                or chunks.shape[2] != states.shape[1] or len(relative) != states.shape[1]:
            raise ValueError(f"states [N, D], chunks [N, chunk, D] and relative [D] expected, got "
                             f"{states.shape}, {chunks.shape}, {len(relative)}")
        rel = np.asarray(relative, np.float64)
        offsets = chunks - states[:, None, :] * rel
        std = lambda x: np.maximum(x.std(axis=0), MIN_STD)  # noqa: E731
        return cls(tuple(states.mean(0).tolist()), tuple(std(states).tolist()),
                   tuple(tuple(r) for r in offsets.mean(0).tolist()), tuple(tuple(r) for r in std(offsets).tolist()),
                   tuple(bool(r) for r in relative))

    # ---- wamrt.json --------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"state_mean": list(self.state_mean), "state_std": list(self.state_std),
                "action_mean": [list(r) for r in self.action_mean], "action_std": [list(r) for r in self.action_std],
                "relative": list(self.relative)}

    @classmethod
    def from_json(cls, obj: Any, *, raw_dim: int, chunk: int, source: str = "wamrt.json") -> ActionNormalization:
        """Validated: a wrong shape, a missing key, a non-finite number or a std <= 0 is a CheckpointError
        naming the field."""
        def fail(field: str, why: str) -> CheckpointError:
            return CheckpointError(f"{source}: {KEY}.{field} {why}")

        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{source}: {KEY} must be an object, got {type(obj).__name__}")

        def numbers(field: str, shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
            if field not in obj:
                raise fail(field, "is missing")
            try:
                arr = np.asarray(obj[field], dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise fail(field, f"is not numeric ({e})") from None
            if arr.shape != shape:
                raise fail(field, f"must have shape {list(shape)}, got {list(arr.shape)}")
            if not np.isfinite(arr).all():
                raise fail(field, "contains NaN or inf")
            if positive and not (arr > 0).all():
                raise fail(field, "must be > 0 everywhere")
            return arr

        sm = numbers("state_mean", (raw_dim,))
        ss = numbers("state_std", (raw_dim,), positive=True)
        am = numbers("action_mean", (chunk, raw_dim))
        sd = numbers("action_std", (chunk, raw_dim), positive=True)
        rel = obj.get("relative")
        if not isinstance(rel, list) or len(rel) != raw_dim or not all(isinstance(r, bool) for r in rel):
            raise fail("relative", f"must be a list of {raw_dim} booleans, got {rel!r}")
        return cls(tuple(sm.tolist()), tuple(ss.tolist()), tuple(tuple(r) for r in am.tolist()),
                   tuple(tuple(r) for r in sd.tolist()), tuple(rel))
