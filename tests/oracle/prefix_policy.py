"""A policy stand-in that honours the prefix request keys and makes every row say where it came from.

The observation's joint 0 holds how far the arm has got: the number of rows it has run (the fake robot's
odometer; standing steps do not count). Reply row k is [progress + k, request number, 0, ...]: wherever a reply is
spliced at the right row, the rows the arm runs read 0, 1, 2, ... in column 0 -- none skipped, none repeated.
With `action_prefix` rows, the reply's first rows are the prefix, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from wamrt.client.realtime import GRIPPER_KEY, JOINT_KEY, PREFIX_KEY, PREFIX_MODE_KEY


def robot_obs(progress: int) -> dict[str, Any]:
    joints = np.zeros(7, np.float32)
    joints[0] = progress
    return {JOINT_KEY: joints, GRIPPER_KEY: np.float32(0.0), "prompt": "track the step"}


class StepPolicy:
    """`infer(obs) -> {"actions": [chunk, 8]}` (the openpi-client shape: no seed keyword)."""

    def __init__(self, chunk: int = 32, honour_prefix: bool = True) -> None:
        self.chunk, self.honour_prefix = chunk, honour_prefix  # False: a policy that ignores the prefix keys
        self.requests: list[dict[str, Any]] = []

    def infer(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        self.requests.append(dict(obs))
        progress = float(np.asarray(obs[JOINT_KEY])[0])
        rows = np.zeros((self.chunk, 8), np.float32)
        rows[:, 0] = progress + np.arange(self.chunk)
        rows[:, 1] = len(self.requests) - 1
        prefix = np.asarray(obs.get(PREFIX_KEY, np.zeros((0, 8))), np.float32)
        assert obs.get(PREFIX_MODE_KEY, "auto") in ("auto", "clean", "inpaint")
        if self.honour_prefix:
            rows[: len(prefix)] = prefix
        return {"actions": rows}
