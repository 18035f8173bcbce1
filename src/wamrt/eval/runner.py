"""Rollouts over N lanes: each lane owns one simulator (and GL context) and runs whole episodes.

Lanes are processes (default; a picklable `agent_factory` builds each lane's agent, e.g. a websocket client
of a shared server) or threads (the agent may share one in-process policy object; MuJoCo and torch release
the GIL in their heavy calls). Episodes are handed out dynamically and results come back in seed order.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sim.env import PandaEnv
from .agents import Agent

AgentFactory = Callable[[], Agent]


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    steps: int
    requests: int
    wall_s: float
    infer_ms: list[float] = field(default_factory=list)
    error: str | None = None
    stage: str = "unknown"  # how far a failure got (see EpisodeProgress.stage): where to look next
    trace: list[str] = field(default_factory=list)  # per request, from agents that keep one (PolicyAgent)
    realtime: dict[str, Any] | None = None  # delay mode (eval.realtime): stalls, delays, jerk sums
    milestones: dict[str, int | None] | None = None  # control step each phase was first reached (EpisodeProgress)


# Progress thresholds: "reached" = the TCP came within grasp range of the target cube's centre; "lifted" = the
# cube rose clear of the table (it was held); a lifted cube that never came to rest on the pad is "not placed".
REACH_M = 0.03
LIFT_M = 0.03


class EpisodeProgress:
    """How far an episode got toward its task, from privileged simulator state sampled after every step."""

    def __init__(self, env: PandaEnv) -> None:
        self.env = env
        self.target = env.layout.target if env.layout is not None else 0
        self.rest_z = float(env.cube_pos(self.target)[2])
        self.min_tcp_cube_m = float("inf")
        self.max_rise_m = 0.0
        self.steps = 0
        self.reach_step: int | None = None  # first step the TCP came within REACH_M of the cube
        self.lift_step: int | None = None  # first step the cube was LIFT_M above its rest

    def update(self) -> None:
        self.steps += 1
        cube = self.env.cube_pos(self.target)
        self.min_tcp_cube_m = min(self.min_tcp_cube_m, float(np.linalg.norm(self.env.tcp_pos() - cube)))
        self.max_rise_m = max(self.max_rise_m, float(cube[2]) - self.rest_z)
        if self.reach_step is None and self.min_tcp_cube_m <= REACH_M:
            self.reach_step = self.steps
        if self.lift_step is None and self.max_rise_m >= LIFT_M:
            self.lift_step = self.steps

    def milestones(self, success: bool) -> dict[str, int | None]:
        """Where an episode's steps went: the step it first reached the cube, lifted it, and succeeded (None where
        it never did). A slow phase shows here before it shows as a failure at the step limit."""
        return {"reach": self.reach_step, "lift": self.lift_step, "success": self.steps if success else None}

    def stage(self, success: bool) -> str:
        if success:
            return "success"
        if self.env.halted:
            return "protective_stop"
        if self.max_rise_m >= LIFT_M:
            return "lifted_not_placed" if self.env.spec.uses_pad else "lifted_too_low"
        return "reached_not_lifted" if self.min_tcp_cube_m <= REACH_M else "never_reached"


def run_episode(env: PandaEnv, agent: Agent, seed: int, max_steps: int | None = None) -> EpisodeResult:
    """One episode: ask the agent for rows, execute them open-loop, stop at success or the step limit.

    Pixels are rendered only for observations the agent will see (the last row of each executed chunk). An agent
    with its own `episode(env, seed, max_steps)` loop (eval.realtime: one row per control tick) runs that."""
    if hasattr(agent, "episode"):
        return agent.episode(env, seed, max_steps)
    t0 = time.perf_counter()
    limit = max_steps or env.spec.max_steps
    obs = env.reset(seed, render=agent.needs_images)
    agent.start(env, seed)
    steps = requests = 0
    success = False
    n_infer = len(getattr(agent, "infer_ms", []))
    progress = EpisodeProgress(env)
    try:
        while steps < limit and not success and not env.halted:
            rows = agent.actions(env, obs)
            requests += 1
            for k, row in enumerate(rows):
                last = k == len(rows) - 1 or steps + 1 >= limit
                obs = env.step(row, render=agent.needs_images and last)
                steps += 1
                success = env.success()
                progress.update()
                if success or steps >= limit or env.halted:
                    break
    except Exception:  # noqa: BLE001  one broken episode must not take the lane down: record it as a failure
        return EpisodeResult(seed, False, steps, requests, time.perf_counter() - t0,
                             error=traceback.format_exc(limit=3), stage="error")
    infer = list(getattr(agent, "infer_ms", [])[n_infer:])
    return EpisodeResult(seed, success, steps, requests, time.perf_counter() - t0, infer,
                         stage=progress.stage(success), trace=list(getattr(agent, "trace", [])),
                         milestones=progress.milestones(success))


# ---- lanes ----------------------------------------------------------------------------------------------
# Per-process lane state (process backend): one env and one agent per worker process.
_lane = threading.local()


def _lane_init(task: str, agent_factory: AgentFactory, env_kwargs: dict[str, Any]) -> None:
    agent = agent_factory()
    _lane.env = PandaEnv(task, **{"render": agent.needs_images, **env_kwargs})
    _lane.agent = agent


def _lane_run(seed: int, max_steps: int | None) -> EpisodeResult:
    return run_episode(_lane.env, _lane.agent, seed, max_steps)


def _thread_lane(task: str, agent_factory: AgentFactory, env_kwargs: dict[str, Any], todo: queue.SimpleQueue,
                 max_steps: int | None, report: Callable[[EpisodeResult], None]) -> None:
    agent = agent_factory()
    kw = {"render": agent.needs_images, **env_kwargs}
    with PandaEnv(task, **kw) as env:  # the GL context is created, used and freed in this thread
        while True:
            try:
                seed = todo.get_nowait()
            except queue.Empty:
                return
            report(run_episode(env, agent, seed, max_steps))


def run_rollouts(
    task: str,
    agent_factory: AgentFactory,
    seeds: Sequence[int],
    *,
    lanes: int = 1,
    backend: str = "process",
    env_kwargs: dict[str, Any] | None = None,
    max_steps: int | None = None,
    progress: bool = False,
    start_method: str = "spawn",
    on_result: Callable[[EpisodeResult], None] | None = None,
) -> list[EpisodeResult]:
    """Run one episode per seed over `lanes` workers; returns results in the order of `seeds`. `on_result` sees
    each episode as it ends (e.g. a `RolloutProgress`); `progress=True` draws one on stderr."""
    seeds = [int(s) for s in seeds]
    kw = dict(env_kwargs or {})
    results: dict[int, EpisodeResult] = {}
    own_bar = RolloutProgress(len(seeds), task) if progress and on_result is None else None
    on_result = on_result or own_bar

    def report(r: EpisodeResult) -> None:
        results[r.seed] = r
        if on_result is not None:
            on_result(r)

    if len(set(seeds)) != len(seeds):
        raise ValueError("seeds must be unique (results are keyed by seed)")
    if backend == "process" and lanes > 1:
        # spawn: a fresh interpreter per lane, so no GL context or torch thread pool is inherited by fork.
        ctx = mp.get_context(start_method)
        with ctx.Pool(lanes, initializer=_lane_init, initargs=(task, agent_factory, kw)) as pool:
            for r in pool.imap_unordered(_pool_task, [(s, max_steps) for s in seeds]):
                report(r)
    elif backend in ("thread", "process"):
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for s in seeds:
            todo.put(s)
        lock = threading.Lock()

        def locked_report(r: EpisodeResult) -> None:
            with lock:
                report(r)

        with ThreadPoolExecutor(max_workers=max(1, lanes), thread_name_prefix="lane") as ex:
            futures = [ex.submit(_thread_lane, task, agent_factory, kw, todo, max_steps, locked_report)
                       for _ in range(max(1, lanes))]
            for f in futures:
                f.result()  # re-raises a lane's setup error
    else:
        raise ValueError(f"backend must be 'process' or 'thread', got {backend!r}")
    if own_bar is not None:
        own_bar.close()
    return [results[s] for s in seeds]


class RolloutProgress:
    """A progress bar over episodes (stderr) with the running success rate; tqdm gives the rate and the ETA."""

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.done = self.successes = 0
        self.bar = tqdm(total=total, desc=label, unit="episode", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)

    def __call__(self, result: EpisodeResult) -> None:
        self.done += 1
        self.successes += bool(result.success)
        self.bar.set_postfix_str(f"success {self.successes}/{self.done} = {self.successes / self.done:.0%}",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _pool_task(args: tuple[int, int | None]) -> EpisodeResult:
    return _lane_run(*args)


def summarize(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    infer = [x for r in results for x in r.infer_ms]
    return {
        "episodes": len(results),
        "successes": sum(r.success for r in results),
        "errors": sum(r.error is not None for r in results),
        "mean_steps": float(np.mean([r.steps for r in results])) if results else 0.0,
        "stages": dict(sorted(Counter(r.stage for r in results).items())),
        "infer_p50_ms": float(np.median(infer)) if infer else None,
        "episode_wall_p50_s": float(np.median([r.wall_s for r in results])) if results else None,
        "phase_steps_median": phase_steps_median(results),
    }


def phase_steps_median(results: Sequence[EpisodeResult]) -> dict[str, float | None]:
    """Median steps of each phase over the episodes that finished it: start -> reach, reach -> lift, lift ->
    success. A policy that is right but slow (a timeout, counted as a failure) shows which phase it is slow in."""
    spans: dict[str, list[int]] = {"reach": [], "reach_to_lift": [], "lift_to_success": []}
    for r in results:
        m = r.milestones or {}
        reach, lift, done = m.get("reach"), m.get("lift"), m.get("success")
        if reach is not None:
            spans["reach"].append(reach)
        if reach is not None and lift is not None:
            spans["reach_to_lift"].append(lift - reach)
        if lift is not None and done is not None:
            spans["lift_to_success"].append(done - lift)
    return {k: float(np.median(v)) if v else None for k, v in spans.items()}
