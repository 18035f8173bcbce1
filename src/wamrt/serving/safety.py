"""Optional action safety envelope for real robots (`wamrt serve --safety FILE`).

The file (JSON, or TOML by extension) names per-embodiment joint limits and a maximum per-step joint
change; `mode` chooses whether a violating chunk is clamped into the envelope or rejected:

    {"default": "droid",
     "embodiments": {"droid": {"mode": "clamp",
                               "joint_lower": [7 floats], "joint_upper": [7 floats],
                               "max_step_delta": 0.2 or [7 floats],
                               "gripper": [0.0, 1.0]}}}

Step changes are measured between consecutive action rows and from the observed joint state to row 0.
Off by default: with no file the server returns the model's actions untouched.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .errors import InvalidRequest, SafetyRejected

NUM_JOINTS = 7


@dataclass(frozen=True)
class Envelope:
    mode: Literal["clamp", "reject"]
    lower: np.ndarray  # [7]
    upper: np.ndarray  # [7]
    max_step: np.ndarray  # [7]; inf = unlimited
    gripper: tuple[float, float] | None = None


@dataclass(frozen=True)
class SafetyReport:
    mode: str
    embodiment: str
    violations: int  # entries that broke a limit before any clamping
    clamped: bool

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "embodiment": self.embodiment, "violations": self.violations,
                "clamped": self.clamped}


def _vec(value: Any, name: str, default: float) -> np.ndarray:
    if value is None:
        return np.full(NUM_JOINTS, default, dtype=np.float64)
    arr = np.broadcast_to(np.asarray(value, dtype=np.float64), (NUM_JOINTS,)).copy()
    if np.isnan(arr).any():
        raise ValueError(f"safety file: {name} has NaN")
    return arr


def _envelope(spec: dict[str, Any], name: str) -> Envelope:
    mode = spec.get("mode", "clamp")
    if mode not in ("clamp", "reject"):
        raise ValueError(f"safety file: embodiment {name!r}: mode must be 'clamp' or 'reject', got {mode!r}")
    lower = _vec(spec.get("joint_lower"), "joint_lower", -np.inf)
    upper = _vec(spec.get("joint_upper"), "joint_upper", np.inf)
    step = _vec(spec.get("max_step_delta"), "max_step_delta", np.inf)
    if (lower > upper).any() or (step <= 0).any():
        raise ValueError(f"safety file: embodiment {name!r}: need joint_lower <= joint_upper, max_step_delta > 0")
    grip = spec.get("gripper")
    if grip is not None and (len(grip) != 2 or grip[0] > grip[1]):
        raise ValueError(f"safety file: embodiment {name!r}: gripper must be [lo, hi]")
    return Envelope(mode, lower, upper, step, tuple(map(float, grip)) if grip is not None else None)


class SafetyEnvelope:
    def __init__(self, embodiments: dict[str, Envelope], default: str) -> None:
        if default not in embodiments:
            raise ValueError(f"safety file: default embodiment {default!r} is not defined")
        self.embodiments, self.default = embodiments, default

    @classmethod
    def load(cls, path: str | Path) -> SafetyEnvelope:
        p = Path(path)
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        specs = data.get("embodiments")
        if not isinstance(specs, dict) or not specs:
            raise ValueError("safety file: needs a non-empty 'embodiments' map")
        envs = {name: _envelope(spec, name) for name, spec in specs.items()}
        return cls(envs, data.get("default", next(iter(envs))))

    def apply(self, actions: np.ndarray, state: np.ndarray | None,
              embodiment: str | None = None) -> tuple[np.ndarray, SafetyReport]:
        """actions [T, 8] (7 joints + gripper), state [7] or None -> (actions to send, report).
        Raises SafetyRejected in reject mode when anything is out of the envelope."""
        name = embodiment or self.default
        env = self.embodiments.get(name)
        if env is None:
            raise InvalidRequest(f"no safety envelope for embodiment {name!r}", field="embodiment")
        joints = actions[:, :NUM_JOINTS].astype(np.float64)
        prev = np.concatenate([state[None].astype(np.float64), joints[:-1]]) if state is not None else None
        bad = (joints < env.lower) | (joints > env.upper)
        if prev is not None:
            bad |= np.abs(joints - prev) > env.max_step + 1e-9
        else:
            bad[1:] |= np.abs(np.diff(joints, axis=0)) > env.max_step + 1e-9
        grip_bad = 0
        if env.gripper is not None:
            g = actions[:, NUM_JOINTS]
            grip_bad = int(((g < env.gripper[0]) | (g > env.gripper[1])).sum())
        violations = int(bad.sum()) + grip_bad
        if violations == 0:
            return actions, SafetyReport(env.mode, name, 0, False)
        if env.mode == "reject":
            raise SafetyRejected(f"action chunk leaves the {name!r} safety envelope ({violations} violations)")
        out = actions.astype(np.float32, copy=True)
        last = state.astype(np.float64) if state is not None else None
        for t in range(len(out)):  # clamp to limits, then rate-limit against the previous (clamped) row
            row = np.clip(joints[t], env.lower, env.upper)
            if last is not None:
                row = np.clip(row, last - env.max_step, last + env.max_step)
            out[t, :NUM_JOINTS] = row
            last = row
        if env.gripper is not None:
            out[:, NUM_JOINTS] = np.clip(out[:, NUM_JOINTS], *env.gripper)
        return out, SafetyReport(env.mode, name, violations, True)
