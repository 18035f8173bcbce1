"""The delay mode: a simulator that keeps moving while the policy thinks.

A request sent at control step t with observation o_t is answered at step t + d; during those d steps the arm
executes what the client had committed (`wamrt.client.realtime.RealtimeRunner`, the robot-side runner, driven
by a `SimClock`). d is fixed or drawn per request from a latency model, as a pure function of (episode seed,
request index), so a paired gate still replays request by request. At d = 0 every strategy is the lock-step
rollout (`PolicyAgent`): the request at step t is answered before row t runs.

Pixels are rendered only at request steps. Per episode the runner's log gives: stalled steps (the queue was dry
and the arm held its last target), the delays and prefix lengths of the requests, and jerk -- the third
difference of the commanded joint targets, in rad/s^3 -- split into steps whose stencil spans a switch between
chunks ("boundary") and the rest ("inside").
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..client.clocks import LatencyModel, SimClock, WallClock
from ..client.realtime import GRIPPER_KEY, JOINT_KEY, DelayEstimator, RealtimeRunner, RunnerLog
from ..sim.droid import droid_observation
from ..sim.env import CONTROL_HZ, PandaEnv
from .agents import digest, observation_digest
from .planner import SIM_STATE_KEY, snapshot
from .runner import EpisodeProgress, EpisodeResult


def jerk_sums(log: RunnerLog, hz: float = CONTROL_HZ) -> dict[str, float]:
    """Sums, counts and maxima of |d^3 q / dt^3| (7 joint targets, rad/s^3) at chunk boundaries and inside."""
    rows = np.asarray(log.rows, dtype=np.float64)[:, :7] if log.rows else np.zeros((0, 7))
    out = {"boundary_sum": 0.0, "boundary_n": 0, "boundary_max": 0.0, "inside_sum": 0.0, "inside_n": 0,
           "inside_max": 0.0}
    if len(rows) < 4:
        return out
    jerk = np.linalg.norm(rows[3:] - 3 * rows[2:-1] + 3 * rows[1:-2] - rows[:-3], axis=1) * hz**3
    chunk = np.asarray(log.chunk)
    switch = np.r_[False, chunk[1:] != chunk[:-1]]  # step k runs a row of another chunk than step k - 1
    # jerk[i] is centred on steps i..i+3: it spans a switch if step i+1, i+2 or i+3 switched.
    spans = switch[1:-2] | switch[2:-1] | switch[3:]
    for name, sel in (("boundary", spans), ("inside", ~spans)):
        if sel.any():
            out[f"{name}_sum"] = float(jerk[sel].sum())
            out[f"{name}_n"] = int(sel.sum())
            out[f"{name}_max"] = float(jerk[sel].max())
    return out


def episode_metrics(log: RunnerLog) -> dict[str, Any]:
    return {"steps": len(log.rows), "stalled": int(sum(log.stalled)), "delays": list(log.delays),
            "prefix_rows": list(log.prefix_rows), "lost_replies": log.lost, **jerk_sums(log)}


@dataclass(frozen=True)
class RealtimeSettings:
    """How a delay-mode run executes chunks: the strategy, the delay model, the prefix mode, the request period,
    and whether time is simulated (seeded delays) or real (`wall_clock`: a 15 Hz loop against a live server)."""

    strategy: str = "async"
    latency: LatencyModel = field(default_factory=lambda: LatencyModel(steps=0))
    prefix_mode: str = "auto"
    execute_steps: int = 8
    wall_clock: bool = False

    def describe(self) -> dict[str, Any]:
        out = {"strategy": self.strategy, "execute_steps": self.execute_steps, "clock": "wall" if self.wall_clock
               else "simulated"}
        if self.strategy == "prefix":
            out["prefix_mode"] = self.prefix_mode
        if not self.wall_clock:
            out.update(self.latency.describe())
        return out


class RealtimeAgent:
    """A lane agent that runs whole episodes on the robot's clock (see the module doc). `policy` is anything
    with `infer(obs, ...)` (an in-process Policy, a RemotePolicy, an ExpertPlanner); `privileged` adds the
    simulator state to every observation (the expert planner) and skips the cameras."""

    def __init__(self, policy: Any, settings: RealtimeSettings, *, privileged: bool = False,
                 **infer_kwargs: Any) -> None:
        self.policy, self.privileged, self.settings = policy, privileged, settings
        self.needs_images = not privileged
        self.clock = WallClock() if settings.wall_clock else SimClock(settings.latency)
        # Simulated time: the runner starts each episode knowing the model's median delay, as a robot that timed its
        # server before starting would (else every episode's first prefix would be empty).
        estimator = DelayEstimator(initial=0 if settings.wall_clock else settings.latency.nominal_steps())
        self.runner = RealtimeRunner(policy, strategy=settings.strategy, execute_steps=settings.execute_steps,
                                     clock=self.clock, prefix_mode=settings.prefix_mode, estimator=estimator,
                                     **infer_kwargs)
        call = self.runner.call
        assert call is not None

        def traced(obs: dict[str, Any], seed: int | None) -> np.ndarray:
            t0 = time.perf_counter()
            rows = call(obs, seed)
            self.infer_ms.append((time.perf_counter() - t0) * 1e3)
            public = {k: v for k, v in obs.items() if k != SIM_STATE_KEY}
            self.runner.log.trace.append(f"{observation_digest(public)}:{digest(rows)}")
            return rows

        self.runner.call = traced
        self.infer_ms: list[float] = []

    def start(self, env: PandaEnv, episode_seed: int) -> None:
        """Unused: `episode` runs the whole loop (eval.runner.run_episode calls it)."""

    def _observer(self, env: PandaEnv, seed: int) -> Any:
        def observe() -> dict[str, Any]:
            if self.privileged:
                obs = {JOINT_KEY: env.joint_position().astype(np.float32),
                       GRIPPER_KEY: np.float32(env.gripper_position()), "prompt": env.layout.instruction,
                       SIM_STATE_KEY: snapshot(env, seed)}
            else:
                obs = droid_observation(env.observe(render=True))
            return obs

        return observe

    def episode(self, env: PandaEnv, seed: int, max_steps: int | None = None) -> EpisodeResult:
        t0 = time.perf_counter()
        limit = max_steps or env.spec.max_steps
        n_infer = len(self.infer_ms)
        env.reset(seed, render=False)
        runner = self.runner
        runner.start(seed)
        observe = self._observer(env, seed)
        progress = EpisodeProgress(env)
        success, steps, first_success = False, 0, None
        try:
            while steps < limit and not success:
                row = runner.step(observe)
                env.step(row, render=False)
                steps += 1
                success = env.success()
                progress.update()
            first_success = steps if success else None
        except Exception:  # noqa: BLE001  one broken episode must not take the lane down
            return EpisodeResult(seed, False, steps, runner.requests, time.perf_counter() - t0,
                                 error=traceback.format_exc(limit=3), stage="error",
                                 realtime=episode_metrics(runner.log))
        metrics = episode_metrics(runner.log)
        metrics["steps_to_success"] = first_success
        latencies = self.clock.latencies_ms if isinstance(self.clock, WallClock) else self.clock.drawn_ms
        if latencies:
            metrics["latency_ms"] = list(latencies)
            latencies.clear()
        if isinstance(self.clock, WallClock):
            metrics["overruns"] = self.clock.overruns
        return EpisodeResult(seed, success, steps, runner.requests, time.perf_counter() - t0,
                             self.infer_ms[n_infer:], stage=progress.stage(success), trace=list(runner.log.trace),
                             realtime=metrics)


def summarize_realtime(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    """Per-run aggregates of the delay mode (the `realtime` block of a rollout result)."""
    rt = [r.realtime for r in results if r.realtime is not None]
    if not rt:
        return {}
    steps = sum(m["steps"] for m in rt)
    stalled = sum(m["stalled"] for m in rt)
    delays = [d for m in rt for d in m["delays"]]
    to_success = [m["steps_to_success"] for m in rt if m.get("steps_to_success") is not None]

    def mean(name: str) -> float | None:
        n = sum(m[f"{name}_n"] for m in rt)
        return sum(m[f"{name}_sum"] for m in rt) / n if n else None

    boundary, inside = mean("boundary"), mean("inside")
    out = {"control_steps": steps, "stalled_steps": stalled, "stall_fraction": stalled / steps if steps else 0.0,
           "requests": len(delays), "delay_steps_mean": float(np.mean(delays)) if delays else None,
           "delay_steps_max": int(max(delays)) if delays else None,
           "prefix_rows_mean": float(np.mean([p for m in rt for p in m["prefix_rows"]])) if delays else None,
           "lost_replies": sum(m["lost_replies"] for m in rt),
           "steps_to_success_mean": float(np.mean(to_success)) if to_success else None,
           "steps_to_success_median": float(np.median(to_success)) if to_success else None,
           "jerk_boundary_mean": boundary, "jerk_inside_mean": inside,
           "jerk_boundary_over_inside": boundary / inside if boundary is not None and inside else None,
           "jerk_boundary_max": max(m["boundary_max"] for m in rt), "jerk_inside_max": max(m["inside_max"] for m in rt),
           "jerk_units": "rad/s^3, |third difference of the 7 commanded joint targets| x 15^3"}
    latencies = [x for m in rt for x in m.get("latency_ms", [])]
    if latencies:  # drawn by the latency model, or measured by the wall clock
        out["latency_ms_p50"] = float(np.median(latencies))
        out["latency_ms_p99"] = float(np.quantile(latencies, 0.99))
    if any("overruns" in m for m in rt):
        out["overrun_ticks"] = sum(m.get("overruns", 0) for m in rt)
    return out


@dataclass
class RealtimeAgentFactory:
    """Picklable lane factory for process lanes: the expert planner ("expert") or a server URL."""

    task: str
    policy: str  # "expert" or ws://...
    settings: RealtimeSettings
    overrides: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None

    def __call__(self) -> RealtimeAgent:
        if self.policy == "expert":
            from .planner import ExpertPlanner

            return RealtimeAgent(ExpertPlanner(self.task), self.settings, privileged=True)
        from .remote import RemotePolicy

        return RealtimeAgent(RemotePolicy(self.policy, self.api_key), self.settings, **self.overrides)
