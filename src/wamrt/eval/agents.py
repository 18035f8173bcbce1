"""What a rollout lane runs: the scripted expert, or any policy with `infer(obs, seed=...) -> .actions`."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ..client.realtime import request_seed
from ..sim.droid import droid_observation
from ..sim.env import Observation, PandaEnv
from ..sim.expert import ScriptedExpert


class Agent(Protocol):
    needs_images: bool

    def start(self, env: PandaEnv, episode_seed: int) -> None: ...

    def actions(self, env: PandaEnv, obs: Observation) -> np.ndarray:
        """The next rows [k, 8] to execute open-loop (k >= 1)."""
        ...


class ExpertAgent:
    """Closed-loop, one row at a time, on privileged state (no pixels needed)."""

    needs_images = False

    def __init__(self) -> None:
        self.expert = ScriptedExpert()

    def start(self, env: PandaEnv, episode_seed: int) -> None:
        self.expert.reset(env)

    def actions(self, env: PandaEnv, obs: Observation) -> np.ndarray:
        return self.expert.act(env)[None]


def digest(*arrays: Any) -> str:
    """8 hex digits of the bytes (and shapes / dtypes) of arrays or strings: a trace entry, not a security hash."""
    h = hashlib.blake2b(digest_size=4)
    for a in arrays:
        if isinstance(a, str):
            h.update(a.encode())
        else:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def observation_digest(obs: Mapping[str, Any]) -> str:
    return digest(*(obs[k] for k in sorted(obs)))


class PolicyAgent:
    """Calls `policy.infer(droid_obs, seed=...)` and executes the first `execute_steps` rows of the chunk."""

    needs_images = True

    def __init__(self, policy: Any, execute_steps: int = 8, **infer_kwargs: Any) -> None:
        if execute_steps < 1:
            raise ValueError("execute_steps must be >= 1")
        self.policy, self.execute_steps, self.infer_kwargs = policy, execute_steps, infer_kwargs
        self.episode_seed, self.requests = 0, 0
        self.infer_ms: list[float] = []
        # Per request "<observation digest>:<actions digest>": two runs of one seed can be compared request by
        # request, and the first difference says which side broke the replay (simulator or policy).
        self.trace: list[str] = []

    def start(self, env: PandaEnv, episode_seed: int) -> None:
        self.episode_seed, self.requests, self.trace = episode_seed, 0, []

    def actions(self, env: PandaEnv, obs: Observation) -> np.ndarray:
        t0 = time.perf_counter()
        request = droid_observation(obs)
        chunk = self.policy.infer(request, seed=request_seed(self.episode_seed, self.requests), **self.infer_kwargs)
        self.infer_ms.append((time.perf_counter() - t0) * 1e3)
        self.requests += 1
        rows = np.asarray(chunk.actions, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != 8 or len(rows) == 0:
            raise ValueError(f"policy returned actions of shape {rows.shape}, expected [chunk, 8]")
        self.trace.append(f"{observation_digest(request)}:{digest(rows)}")
        return rows[: self.execute_steps]
