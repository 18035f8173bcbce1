"""On-policy training data for delayed execution: the policy drives, the expert labels what it should have asked for.

Why (docs/train.md, "Training on the policy's own prefixes"): at d = 10 a prefix-trained policy keeps the
turntable's successes only where its committed rows are right, and in training they always were (the expert's own,
or the expert's plus noise). Served, they are its own earlier rows, planned from a view 10-20 steps old. DAgger
(Ross et al., 2011) applied to that: the grid runs the policy on the robot's clock (`wamrt eval grid
--record-dagger DIR`), and every request it sends is recorded with the chunk the scripted expert would return for
it. The expert plans with the simulator state of the request's step after executing the request's own prefix
(`ExpertPlanner`), so the label's first rows are that prefix and the rest continue from where those rows leave the
arm, in the world as it will be by then.

One `.npz` per episode, the layout of `wamrt.train.data` (canvas, state, actions) plus:

  chunk float32 [T, 32, 8]   the expert's chunk for request t (robot space: joint targets, gripper 0 open .. 1)
  prefix_rows int64 [T]      how many of its first rows were the request's committed prefix (clean in training)
  grasp_unseen bool [T]      the label opens the gripper after a closed prefix for a grasp that fails later, where
                             the request's view could not show it (`grasp_unseen`); training leaves that gripper
                             column out of the loss
  reply float32 [T, 32, 8]   the policy's own answer to request t (NaN where the episode ended before it arrived):
                             how far the policy is from the expert on its own states (`dagger_gap`)

`actions` holds each chunk's row 0, so a reader that knows nothing of `chunk` still sees a valid file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..client.realtime import GRIPPER_KEY, JOINT_KEY, PREFIX_KEY

# Measured gripper closure (0 open .. 1 shut) above which the fingers have closed on nothing: a 5 cm cube holds them
# at 0.375. A request that sees this has seen its grasp miss.
FINGERS_SHUT = 0.9

if TYPE_CHECKING:  # the planner imports the simulator: only where requests are labelled (`dagger_gap` reads files)
    from .planner import ExpertPlanner


class DaggerEpisode:
    """The requests of one episode with their expert labels, written as one file when the episode ends."""

    def __init__(self, task: str, delay: int, seed: int, tier: str, planner: ExpertPlanner) -> None:
        self.task, self.delay, self.seed, self.tier, self.planner = task, delay, seed, tier, planner
        self.canvas: list[np.ndarray] = []
        self.state: list[np.ndarray] = []
        self.chunk: list[np.ndarray] = []
        self.prefix_rows: list[int] = []
        self.grasp_unseen: list[bool] = []
        self.reply: list[np.ndarray] = []
        self.prompt = ""
        self.image_size: tuple[int, ...] = ()

    def add(self, env: Any, obs: dict[str, Any], padded: Any = None) -> None:
        """One request, sent at the current step of `env` with observation dict `obs` (its prefix keys included);
        `padded`: its PaddedCanvas at this tier where the caller composed it already (an engine's host inputs)."""
        from ..pipeline.noise import droid_state_row
        from ..train.data import policy_canvas
        from .planner import SIM_STATE_KEY, snapshot

        prefix = np.asarray(obs.get(PREFIX_KEY, np.zeros((0, 8))), np.float32).reshape(-1, 8)
        label = self.planner.infer({SIM_STATE_KEY: snapshot(env, self.seed), PREFIX_KEY: prefix})["actions"]
        pixels, size = (padded.pixels, padded.image_size) if padded is not None else policy_canvas(obs, self.tier)
        self.canvas.append(pixels)
        self.state.append(droid_state_row(obs[JOINT_KEY], obs[GRIPPER_KEY]))
        self.chunk.append(np.asarray(label, np.float32))
        self.prefix_rows.append(len(prefix))
        self.grasp_unseen.append(grasp_unseen(env, prefix, label))
        self.reply.append(np.full_like(self.chunk[-1], np.nan))
        self.prompt, self.image_size = str(obs["prompt"]), tuple(size)

    def answered(self, index: int, rows: Any) -> Any:
        """The policy's reply to request `index` (as the lane received it), kept where it is a chunk; returned."""
        chunk = np.asarray(rows, np.float32)
        if chunk.shape == self.reply[index].shape:
            self.reply[index] = chunk
        return rows

    def write(self, out_dir: str | Path, success: bool) -> Path | None:
        if not self.chunk:
            return None
        chunk = np.stack(self.chunk)
        meta = {"kind": "dagger", "task": self.task, "seed": int(self.seed), "delay_steps": int(self.delay),
                "prompt": self.prompt, "tier": self.tier, "image_size": list(self.image_size),
                "length": len(chunk), "success": bool(success)}
        final = Path(out_dir) / f"dagger-{self.task}-d{self.delay:02d}-{self.seed:07d}.npz"
        tmp = final.with_suffix(".npz.part")  # renamed when complete: a killed run leaves no truncated episode
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), canvas=np.stack(self.canvas),
                     state=np.stack(self.state).astype(np.float32), actions=chunk[:, 0].copy(), chunk=chunk,
                     prefix_rows=np.asarray(self.prefix_rows, np.int64),
                     grasp_unseen=np.asarray(self.grasp_unseen, bool), reply=np.stack(self.reply))
        os.replace(tmp, final)
        return final


def grasp_unseen(env: Any, prefix: np.ndarray, label: np.ndarray) -> bool:
    """The expert's `label` opens the gripper after a `prefix` that ends closing it, while at the request's step
    (`env`) the target cube is not held and the fingers have not shut on nothing yet: the grasp the prefix closes
    fails within its rows, which the request's view, older than the rows it plans by the prefix's length, need not show.

    Why (bench/results/rollout/2026-12-07-20f01d1-d10-gripper-labels-cpu/): at d = 10 most closed prefixes of the
    policy's own DAgger requests end without the cube held, and their labels open the gripper to try again. Taught
    those, the policy opened after closed prefixes where the grasp was about to hold, and in carries: drops. What a
    request can see is a grasp closing; keeping it closed until a later request sees the fingers shut costs one
    plan, where opening a grasp that holds costs the episode."""
    k = len(prefix)
    if k == 0 or k >= len(label) or prefix[-1, 7] < 0.5:
        return False
    assert env.layout is not None
    if env.cube_held(env.layout.target) or env.gripper_position() >= FINGERS_SHUT:
        return False
    return bool((np.asarray(label)[k:, 7] < 0.5).any())


# The rows of a reply the lane runs before the next reply replaces them: the grid's request period (`execute_steps`).
RUN_ROWS = 8


def gripper_disagrees(chunk: np.ndarray, reply: np.ndarray, prefix_rows: np.ndarray, rows: int = RUN_ROWS
                      ) -> np.ndarray:
    """bool [T]: over the `rows` rows after each request's prefix -- those the arm runs -- the policy's reply
    (`reply` [T, 32, 8], NaN where the lane got none: False) closes the gripper on average where the label (`chunk`)
    keeps it open, or the other way round."""
    out = np.zeros(len(chunk), bool)
    for i, (label, own, p) in enumerate(zip(chunk, reply, prefix_rows, strict=True)):
        label_grip, own_grip = label[p:p + rows, 7], own[p:p + rows, 7]
        if len(own_grip) and not np.isnan(own_grip).any():
            out[i] = (label_grip.mean() > 0.5) != (own_grip.mean() > 0.5)
    return out


def dagger_gap(files: Any, rows: int = RUN_ROWS) -> dict[int, dict[str, float]]:
    """Per delay: the mean absolute joint difference (rad) between the policy's reply and the expert's label over the
    `rows` rows after each request's prefix -- the rows the arm runs next -- on the policy's own states."""
    by_delay: dict[int, list[float]] = {}
    for f in files:
        with np.load(f) as z:
            meta = json.loads(str(z["meta"]))
            for chunk, reply, p in zip(z["chunk"], z["reply"], z["prefix_rows"], strict=True):
                if np.isnan(reply).any():
                    continue
                gap = np.abs(reply[p:p + rows, :7] - chunk[p:p + rows, :7]).mean()
                by_delay.setdefault(int(meta["delay_steps"]), []).append(float(gap))
    return {d: {"requests": len(v), "mean_rad": float(np.mean(v)), "median_rad": float(np.median(v)),
                "p90_rad": float(np.quantile(v, 0.9))} for d, v in sorted(by_delay.items())}
