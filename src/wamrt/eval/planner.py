"""The scripted expert as a chunk policy: the physics check of the delay mode, with no model in the loop.

`ExpertPlanner.infer(obs)` answers like a policy -- 32 rows of [7 joint targets, gripper] -- by copying the
simulator state of the observation's step into a private simulator and running the expert there: the plan is
what the expert would do from that observation on, with a perfect model of the world (the disc keeps turning).
It honours the request keys of the prefix interface: with `action_prefix` rows, the private simulator first
executes them and the expert plans from the state the arm will be in after them (the prefix idea); without,
the plan starts at the observation (what a naive asynchronous client executes from its row d on).

The observation carries the privileged state under `SIM_STATE_KEY` (in-process only; a server never sees it).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client.realtime import PREFIX_KEY
from ..sim.env import PandaEnv
from ..sim.expert import ScriptedExpert

SIM_STATE_KEY = "wamrt/sim_state"
CHUNK = 32


@dataclass
class SimSnapshot:
    """Everything a planner needs to continue an episode: the layout's seed, the full MuJoCo state, the last
    command (before actuation noise), and the step."""

    seed: int
    data: Any  # mujoco.MjData, copied
    last_action: np.ndarray
    step: int
    halted: bool = False  # a protective stop happened (the arm holds)


def snapshot(env: PandaEnv, seed: int) -> SimSnapshot:
    return SimSnapshot(seed, copy.copy(env.data), env.last_action.copy(), env.step_count, env.halted)


class ExpertPlanner:
    """`infer(obs, seed=None) -> {"actions": [horizon, 8]}` from `obs[SIM_STATE_KEY]` (see the module doc)."""

    def __init__(self, task: str, horizon: int = CHUNK, variation: float = 0.0,
                 turntable_rate: float | None = None) -> None:
        """variation: each plan approaches and descends at its own speed, drawn from the request seed in
        [1 - variation, 1 + variation] x the expert's: plans that disagree from sample to sample, as a generative
        policy's chunks do (0: the deterministic expert, whose consecutive plans agree).
        turntable_rate: plan as if the disc turned at this rate (rad/s), not at the episode's own: a planner that,
        like a policy seeing one frame, cannot know this episode's speed (None: the true one)."""
        if not 0.0 <= variation < 1.0:
            raise ValueError(f"variation must be in [0, 1), got {variation}")
        self.task, self.horizon, self.variation = task, horizon, variation
        self.turntable_rate = turntable_rate
        self.env = PandaEnv(task, render=False)  # no actuation noise: the plan assumes the arm obeys
        self.expert = ScriptedExpert()
        self._layout_seed: int | None = None

    def infer(self, obs: Mapping[str, Any], seed: int | None = None) -> dict[str, np.ndarray]:
        snap = obs.get(SIM_STATE_KEY)
        if not isinstance(snap, SimSnapshot):
            raise ValueError(f"the expert planner needs the simulator state under {SIM_STATE_KEY!r}")
        env = self.env
        if self._layout_seed != snap.seed:  # model-level layout (pad, disc, colours) of this episode
            env.reset(snap.seed, render=False)
            self._layout_seed = snap.seed
        import mujoco  # after wamrt.sim (imported above), which must choose the GL backend before mujoco loads

        mujoco.mj_copyData(env.data, env.model, snap.data)
        env.last_action, env.step_count = snap.last_action.copy(), snap.step
        env.halted = snap.halted
        env._held = snap.last_action.copy()
        if self.turntable_rate is not None:
            env.set_turntable_rate(self.turntable_rate)
        prefix = np.asarray(obs.get(PREFIX_KEY, np.zeros((0, 8))), dtype=np.float32).reshape(-1, 8)
        rows = [row for row in prefix[: self.horizon]]
        for row in rows:
            env.step(row, render=False)
        self.expert.resume(env)
        if self.variation:
            rng = np.random.default_rng([0 if seed is None else int(seed), 0x5CA1E])
            self.expert.speed_scale = float(rng.uniform(1 - self.variation, 1 + self.variation))
        while len(rows) < self.horizon:
            action = self.expert.act(env)
            env.step(action, render=False)
            rows.append(action)
        return {"actions": np.stack(rows).astype(np.float32)}

    def close(self) -> None:
        self.env.close()
