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
from collections.abc import Callable, Sequence
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
    # Every strategy stands until the episode's first chunk arrives (nothing is committed yet); a stall after it is
    # the one a strategy can avoid.
    waiting = next((i for i, s in enumerate(log.stalled) if not s), len(log.stalled))
    return {"steps": len(log.rows), "stalled": int(sum(log.stalled)),
            "stalled_after_first_chunk": int(sum(log.stalled[waiting:])), "delays": list(log.delays),
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
    seam_rows: int = 0  # prefix: rows after the prefix cross-faded from the old plan (client/realtime.py)
    binary_gripper: bool = False  # gripper commands rounded to 0 / 1 (client/realtime.py)

    def describe(self) -> dict[str, Any]:
        out = {"strategy": self.strategy, "execute_steps": self.execute_steps, "clock": "wall" if self.wall_clock
               else "simulated"}
        if self.strategy == "prefix":
            out["prefix_mode"] = self.prefix_mode
            out["seam_rows"] = self.seam_rows
        if self.binary_gripper:
            out["binary_gripper"] = True
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
        # Simulated time: the estimate starts at the model's median delay, as a robot that timed its server before
        # starting would (the first request of an episode carries no prefix either way: nothing is queued yet).
        estimator = DelayEstimator(initial=0 if settings.wall_clock else settings.latency.nominal_steps())
        self.runner = RealtimeRunner(policy, strategy=settings.strategy, execute_steps=settings.execute_steps,
                                     clock=self.clock, prefix_mode=settings.prefix_mode, estimator=estimator,
                                     seam_rows=settings.seam_rows, binary_gripper=settings.binary_gripper,
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

    def episode(self, env: PandaEnv, seed: int, max_steps: int | None = None) -> EpisodeResult:
        n_infer = len(self.infer_ms)
        ep = LaneEpisode(env, self.runner, seed, max_steps, privileged=self.privileged)
        while not ep.done:
            request = ep.begin()
            if request is not None:
                self.runner.dispatch(request)
            self.clock.flush()
            ep.end()
        return ep.result(self.infer_ms[n_infer:])


def observer(env: PandaEnv, seed: int, privileged: bool) -> Callable[[], dict[str, Any]]:
    """The lazy observation of a lane: rendered (or, for the expert planner, privileged) only when asked for."""

    def observe() -> dict[str, Any]:
        if privileged:
            assert env.layout is not None
            return {JOINT_KEY: env.joint_position().astype(np.float32), GRIPPER_KEY: np.float32(env.gripper_position()),
                    "prompt": env.layout.instruction, SIM_STATE_KEY: snapshot(env, seed)}
        return droid_observation(env.observe(render=True))

    return observe


class LaneEpisode:
    """One episode on the robot's clock, a control tick at a time: `begin()` may return a request (to dispatch),
    `end()` runs the tick's row. A failure ends the episode and is recorded, never raised."""

    def __init__(self, env: PandaEnv, runner: RealtimeRunner, seed: int, max_steps: int | None = None, *,
                 privileged: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.env, self.runner, self.seed = env, runner, seed
        self.limit = max_steps or env.spec.max_steps
        env.reset(seed, render=False)
        runner.start(seed)
        self.observe = observer(env, seed, privileged)
        self.progress = EpisodeProgress(env)
        self.steps, self.success, self.error = 0, False, None

    @property
    def done(self) -> bool:
        return self.success or self.steps >= self.limit or self.error is not None or self.env.halted

    def begin(self) -> Any:
        try:
            return self.runner.begin(self.observe)
        except Exception:  # noqa: BLE001  one broken episode must not take the lane down
            self.error = traceback.format_exc(limit=3)
            return None

    def end(self) -> None:
        if self.error is not None:
            return
        try:
            row = self.runner.end()
            self.env.step(row, render=False)
            self.steps += 1
            self.success = self.env.success()
            self.progress.update()
        except Exception:  # noqa: BLE001
            self.error = traceback.format_exc(limit=3)

    def result(self, infer_ms: list[float] | None = None) -> EpisodeResult:
        runner, clock = self.runner, self.runner.clock
        metrics = episode_metrics(runner.log)
        metrics["steps_to_success"] = self.steps if self.success else None
        metrics["protective_stop"] = self.env.halted
        latencies = getattr(clock, "latencies_ms", None) if isinstance(clock, WallClock) else getattr(
            clock, "drawn_ms", None)
        if latencies:
            metrics["latency_ms"] = list(latencies)
            latencies.clear()
        if isinstance(clock, WallClock):
            metrics["overruns"] = clock.overruns
        wall = time.perf_counter() - self.t0
        if self.error is not None:
            return EpisodeResult(self.seed, False, self.steps, runner.requests, wall, error=self.error, stage="error",
                                 realtime=metrics)
        return EpisodeResult(self.seed, self.success, self.steps, runner.requests, wall, list(infer_ms or []),
                             stage=self.progress.stage(self.success), trace=list(runner.log.trace), realtime=metrics,
                             milestones=self.progress.milestones(self.success))


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
           "stalled_after_first_chunk": sum(m.get("stalled_after_first_chunk", 0) for m in rt),
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
    out["protective_stops"] = sum(bool(m.get("protective_stop")) for m in rt)  # episodes a reflex ended
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
