"""The strategy x delay grid: every cell's 200 paired episodes in one run, many lanes batched per policy call.

Cells are (task, d, strategy). At d = 0 every strategy is the lock-step rollout, so the d = 0 cells of strategies
that share a policy are run once (`Cell.key`). The episodes of all cells are spread over worker processes (the
physics and the cameras: one core each); each worker runs `lanes` episodes side by side, one control tick at a
time, rendering only at request steps. Requests go to this process, which batches them across workers and lanes
into one `infer_batch` call per policy (an in-process Policy / Engine on the GPU, or a server over websockets);
replies go back to the lanes, which see them d ticks after asking (simulated time). The expert planner
(`--policy expert`) runs inside the workers instead (it needs the simulator state, no GPU).

Order: cells of the first task first, within a task the d = 0 cells, then `priority` delays, then the rest; each
worker takes every W-th episode of that list, so cells finish roughly in order and a time budget that runs out
leaves the most important cells complete (a cell cut short is written with the seeds it has, `complete: false`).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

NO_CANVAS = np.zeros((0, 0, 3), np.uint8)  # in a worker's prepared request, see _worker

# The seam the `-seam` strategies run with (rows after the prefix cross-faded from the old plan; client/realtime.py).
# 4: on the CPU pilot of the first prefix fine-tune at d = 10 it took turntable's protective stops from 12/24 to 0
# and the boundary jerk from 2.1x the jerk inside chunks to 1.0x
# (bench/results/rollout/2026-12-05-cf940b1-cpu-pilot-turntable/).
SEAM_ROWS = 4
# How long a worker blocked on a reply waits for the other workers' requests to join its call, unless all of them
# block first. A call costs mostly a fixed time (H100, 36131c6: ~171 ms + ~3.9 ms a request), so a batch served the
# moment one worker's requests arrived (mean 16.5 of 15 workers x 16 lanes) paid that time once per worker.
# Nothing is served while no worker is blocked: in the delay mode a request is needed d ticks after it is sent, and
# serving it sooner only splits the requests of those d ticks into more, smaller calls (a DAgger recording on the
# H100 called the policy with 6.5 requests on average, 190 ms a call; 32f71d4).
MERGE_WAIT_S = 0.05

# grid strategy -> (runner strategy, action_prefix_mode, which policy, seam rows: None = the run's --seam-rows)
GRID_STRATEGIES: dict[str, tuple[str, str, str, int | None]] = {
    "sync": ("sync", "auto", "base", None),
    "async": ("async", "auto", "base", None),
    "blend": ("blend", "auto", "base", None),
    "prefix": ("prefix", "auto", "base", None),
    "prefix-inpaint": ("prefix", "inpaint", "base", None),
    "prefix-trained": ("prefix", "clean", "trained", None),
    "prefix-inpaint-seam": ("prefix", "inpaint", "base", SEAM_ROWS),
    "prefix-trained-seam": ("prefix", "clean", "trained", SEAM_ROWS),
    "prefix-guided": ("prefix", "guided", "base", None),  # RTC guidance: the eager reference only
}


@dataclass(frozen=True)
class Cell:
    task: str
    delay: int
    strategy: str  # a GRID_STRATEGIES name; at d = 0 the first strategy of its policy that asked for it

    @property
    def runner_strategy(self) -> str:
        return GRID_STRATEGIES[self.strategy][0]

    @property
    def prefix_mode(self) -> str:
        return GRID_STRATEGIES[self.strategy][1]

    @property
    def policy(self) -> str:
        return GRID_STRATEGIES[self.strategy][2]

    @property
    def seam_rows(self) -> int | None:
        return GRID_STRATEGIES[self.strategy][3]

    @property
    def key(self) -> tuple[str, int, str]:
        """Cells with one key run the same episodes: at d = 0 only the policy matters."""
        return (self.task, 0, self.policy) if self.delay == 0 else (self.task, self.delay, self.strategy)

    @property
    def name(self) -> str:
        if self.delay == 0:
            return f"{self.task}-d0" + ("-trained" if self.policy == "trained" else "")
        return f"{self.task}-d{self.delay}-{self.strategy}"


def plan_cells(tasks: Sequence[str], delays: Sequence[int], strategies: Sequence[str],
               priority: Sequence[int] = (10,)) -> list[Cell]:
    """Every (task, d, strategy) once, d = 0 shared per policy, in run order (see the module doc)."""
    bad = [s for s in strategies if s not in GRID_STRATEGIES]
    if bad:
        raise ValueError(f"unknown grid strategies {bad} (known: {', '.join(GRID_STRATEGIES)})")
    if any(d < 0 for d in delays):
        raise ValueError("delays must be >= 0")
    order = sorted(set(delays), key=lambda d: (d != 0, d not in priority, list(delays).index(d)))
    cells: dict[tuple[str, int, str], Cell] = {}
    for task in tasks:
        for d in order:
            for s in strategies:
                cell = Cell(task, d, s)
                cells.setdefault(cell.key, cell)
    return list(cells.values())


def cell_for(cells: Sequence[Cell], task: str, delay: int, strategy: str) -> Cell | None:
    key = Cell(task, delay, strategy).key
    return next((c for c in cells if c.key == key), None)


# ---- workers ----------------------------------------------------------------------------------------------
class _Mailbox:
    """The worker's end of the pipe: requests out in one message per tick, replies in as they come."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.replies, self.outbox, self.stop = conn, {}, [], False
        self.next_ticket = 0

    def post(self, policy: str, obs: dict[str, Any], seed: int | None) -> int:
        ticket = self.next_ticket
        self.next_ticket += 1
        self.outbox.append((ticket, policy, obs, seed))
        return ticket

    def send(self) -> None:
        if self.outbox:
            self.conn.send(("requests", self.outbox))
            self.outbox = []

    def _take(self, msg: tuple) -> None:
        if msg[0] == "replies":
            self.replies.update(msg[1])
        elif msg[0] == "stop":
            self.stop = True

    def poll(self) -> None:
        while self.conn.poll():
            self._take(self.conn.recv())

    def get(self, ticket: int) -> Any:
        while ticket not in self.replies:
            self.conn.send(("waiting",))  # this worker can step no further: the policy need not wait for it
            self._take(self.conn.recv())
        reply = self.replies.pop(ticket)
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return reply


def _worker(conn: Connection, episodes: list[tuple[int, int]], cells: list[Cell], lanes: int,
            max_steps: int | None, env_kwargs: dict[str, Any], privileged: bool, execute_steps: int,
            contracts: dict[str, Any], seam_rows: int = 0, planner_kwargs: dict[str, Any] | None = None,
            record: dict[str, str] | None = None, binary_gripper: bool = False) -> None:
    """Run `episodes` ([(cell index, seed)]) on `lanes` simulators side by side; report each result.

    record: {"dir", "tier"}: every request is also written with the expert's label for it (eval/dagger.py).

    contracts: policy name -> its DroidContract where the policy takes prepared host inputs (an Engine): the
    worker validates and composes each request's canvas itself, one core per worker. In the policy's process
    those CPU resizes, contending with every simulator for the cores, were the grid's bottleneck (H200, 716c9e3:
    214 ms per call of 16 requests, 92 s per 200-episode cell)."""
    if contracts:
        import torch

        torch.set_num_threads(1)  # one core per worker: the simulators fill the rest
    from ..client.clocks import SimClock
    from ..client.realtime import DelayEstimator, RealtimeRunner
    from ..pipeline.droid import droid_host_inputs
    from ..pipeline.errors import RequestError
    from ..sim.env import PandaEnv
    from .planner import ExpertPlanner
    from .realtime import LaneEpisode

    mail = _Mailbox(conn)
    todo = deque(episodes)
    envs: dict[int, tuple[str, PandaEnv]] = {}
    planners: dict[tuple[str, int], ExpertPlanner] = {}
    running: dict[int, tuple[int, LaneEpisode]] = {}
    recording: dict[int, Any] = {}  # lane -> its episode's DaggerEpisode (record)

    def planner(task: str, horizon: int) -> ExpertPlanner:  # one per (task, horizon): each holds a simulator
        if (task, horizon) not in planners:
            planners[(task, horizon)] = ExpertPlanner(task, horizon=horizon, **(planner_kwargs or {}))
        return planners[(task, horizon)]

    try:
        while (todo and not mail.stop) or running:
            for lane in range(lanes):  # fill idle lanes
                if lane in running or not todo or mail.stop:
                    continue
                ci, seed = todo.popleft()
                cell = cells[ci]
                if lane not in envs or envs[lane][0] != cell.task:
                    if lane in envs:
                        envs[lane][1].close()
                    envs[lane] = (cell.task, PandaEnv(cell.task, render=not privileged, **env_kwargs))
                policy = None
                if privileged:  # rows a chunk can run: d + max(period, d), plus a margin (cheaper plans at small d)
                    horizon = min(32, cell.delay + max(execute_steps, cell.delay) + 4)
                    policy = planner(cell.task, horizon)
                runner = RealtimeRunner(policy, strategy=cell.runner_strategy, execute_steps=execute_steps,
                                        seam_rows=seam_rows if cell.seam_rows is None else cell.seam_rows,
                                        clock=SimClock(cell.delay), prefix_mode=cell.prefix_mode,
                                        estimator=DelayEstimator(initial=cell.delay), binary_gripper=binary_gripper)
                running[lane] = (ci, LaneEpisode(envs[lane][1], runner, seed, max_steps, privileged=privileged))
                if record is not None and not privileged:
                    from .dagger import DaggerEpisode

                    recording[lane] = DaggerEpisode(cell.task, cell.delay, seed, record["tier"], planner(cell.task, 32))
            for lane, (_ci, ep) in running.items():  # first half of the tick: requests out
                request = ep.begin()
                if request is None:
                    continue
                if privileged:
                    ep.runner.dispatch(request)
                else:
                    name, obs, host = cells[_ci].policy, request.obs, None
                    if name in contracts:
                        try:
                            host = droid_host_inputs(obs, contracts[name])
                            # Without the full 540 x 640 canvas (1 MB; a request keeps it only for inspection,
                            # the engine encodes `padded`): it would more than double what crosses the pipe.
                            obs = replace(host, canvas=NO_CANVAS)
                        except RequestError:  # the policy's own admission reports it, in this lane's slot
                            pass
                    if lane in recording:  # with the canvas just composed for the engine, where there is one
                        try:
                            recording[lane].add(ep.env, request.obs, host.padded if host is not None else None)
                        except Exception:  # noqa: BLE001  a request the expert cannot label: the episode is not kept
                            del recording[lane]
                    ticket = mail.post(name, obs, request.seed)
                    if lane in recording:  # the reply is kept beside the expert's label
                        rec, k = recording[lane], len(recording[lane].chunk) - 1
                        ep.runner.clock.submit(request, lambda t=ticket, r=rec, k=k: r.answered(k, mail.get(t)))
                    else:
                        ep.runner.clock.submit(request, lambda t=ticket: mail.get(t))
            mail.send()
            for lane, (ci, ep) in list(running.items()):  # second half: replies due now, rows run
                ep.end()
                if ep.done:
                    result = ep.result()
                    if lane in recording:
                        recording.pop(lane).write(record["dir"], result.success)  # type: ignore[index]
                    conn.send(("result", ci, result))
                    del running[lane]
            mail.poll()
        conn.send(("done",))
    except Exception:  # noqa: BLE001  the main process reports it and stops the grid
        conn.send(("crash", traceback.format_exc()))
    finally:
        for _, env in envs.values():
            env.close()
        for p in planners.values():
            p.close()


# ---- policy backends (this process) ------------------------------------------------------------------------
class LocalBackend:
    """An in-process Policy or Engine: `infer_batch` of observations with their seeds."""

    def __init__(self, policy: Any, **overrides: Any) -> None:
        self.policy, self.overrides = policy, overrides
        # An Engine admits prepared host inputs (engine/admission.py): the grid's workers make them.
        self.host_contract = getattr(policy, "contract", None) if hasattr(policy, "_host_inputs") else None
        self.last_stage_ms: dict[str, float] | None = None

    def infer_batch(self, observations: list[dict[str, Any]], seeds: list[int | None]) -> list[Any]:
        out = self.policy.infer_batch(observations, seeds=seeds, **self.overrides)
        self.last_stage_ms = call_stages(out)
        return [r if isinstance(r, Exception) else np.asarray(r.actions, np.float32) for r in out]


def call_stages(results: list[Any]) -> dict[str, float] | None:
    """Where one batched call's time went, from its first answered request's `timings_ms`: the batch-level stages
    (VAE encode, denoise, the call's total) are charged to every request of the call, so one request shows the
    call. The eager reference's per-step keys (`denoise_step<i>`) are parts of its `denoise` and left out."""
    chunk = next((r for r in results if getattr(r, "timings_ms", None)), None)
    if chunk is None:
        return None
    return {k: float(ms) for k, ms in chunk.timings_ms.items() if not k.startswith("denoise_step")}


class RemoteBackend:
    """A `wamrt serve` URL: each batch goes out as concurrent requests on `connections` websockets, which the
    server batches again."""

    def __init__(self, url: str, connections: int = 32, api_key: str | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from .remote import RemotePolicy

        self.clients = [RemotePolicy(url, api_key) for _ in range(connections)]
        self.pool = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="grid-ws")

    def infer_batch(self, observations: list[dict[str, Any]], seeds: list[int | None]) -> list[Any]:
        def one(i: int) -> Any:
            try:
                return self.clients[i % len(self.clients)].infer(observations[i], seed=seeds[i]).actions
            except Exception as e:  # noqa: BLE001  the lane gets the error
                return e

        results: list[Any] = [None] * len(observations)
        for start in range(0, len(observations), len(self.clients)):  # one request per connection at a time
            idx = range(start, min(len(observations), start + len(self.clients)))
            for i, r in zip(idx, self.pool.map(one, idx), strict=True):
                results[i] = r
        return results


# ---- the run --------------------------------------------------------------------------------------------------
@dataclass
class GridRun:
    results: dict[int, list[Any]]  # cell index -> EpisodeResults (seed order)
    wall_s: float
    batches: list[int]  # batch size of every policy call
    batch_ms: list[float]
    stopped_early: bool
    stage_ms: list[dict[str, float]] = field(default_factory=list)  # per call, where the backend reports stages

    def stage_ms_mean(self) -> dict[str, float]:
        """Each stage's mean over the calls that report it (an in-process Engine does; a server does not)."""
        keys = sorted({k for s in self.stage_ms for k in s})
        return {k: float(np.mean([s[k] for s in self.stage_ms if k in s])) for k in keys}

    def policy_busy_share(self) -> float:
        """The share of the wall the policy process spent inside policy calls (the rest: waiting for requests)."""
        return sum(self.batch_ms) / 1e3 / self.wall_s if self.wall_s > 0 else 0.0


def run_grid(cells: Sequence[Cell], seeds: Sequence[int], backends: dict[str, Any] | None, *, workers: int = 2,
             lanes: int = 8, max_batch: int = 64, max_steps: int | None = None,
             env_kwargs: dict[str, Any] | None = None, execute_steps: int = 8, seam_rows: int = 0,
             budget_s: float | None = None, planner_kwargs: dict[str, Any] | None = None,
             record: dict[str, str] | None = None, progress: Callable[[str], None] | None = None,
             on_cell: Callable[[int, list[Any]], None] | None = None, binary_gripper: bool = False) -> GridRun:
    """backends: policy name ("base", "trained") -> LocalBackend / RemoteBackend; None: the expert planner
    (`planner_kwargs` for its ExpertPlanner).
    record: {"dir": folder, "tier": the policy's canvas tier}: the policy's requests with expert labels
    (eval/dagger.py), one file per episode.
    `on_cell(cell index, results)` runs as each cell completes."""
    t0 = time.perf_counter()
    cells = list(cells)
    items = [(ci, int(s)) for ci in range(len(cells)) for s in seeds]
    workers = max(1, min(workers, len(items)))
    ctx = mp.get_context("spawn")
    contracts = {name: b.host_contract for name, b in (backends or {}).items()
                 if getattr(b, "host_contract", None) is not None}
    conns, procs = [], []
    for w in range(workers):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, name=f"grid-worker-{w}", daemon=True,
                        args=(child, items[w::workers], cells, lanes, max_steps, dict(env_kwargs or {}),
                              backends is None, execute_steps, contracts, seam_rows, planner_kwargs, record,
                              binary_gripper))
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    results: dict[int, dict[int, Any]] = {ci: {} for ci in range(len(cells))}
    pending: deque[tuple[Connection, int, str, dict[str, Any], int | None]] = deque()
    batches, batch_ms, stage_ms, live, stopped = [], [], [], set(range(workers)), False
    # workers blocked on a reply, since when: once every live one is, nothing more comes until a call
    waiting: dict[int, float] = {}
    try:
        while live:
            first_wait = min(waiting.values(), default=None)
            timeout = 1.0 if first_wait is None or not pending else \
                max(0.0, first_wait + MERGE_WAIT_S - time.perf_counter())
            ready = wait([conns[w] for w in live], timeout=timeout)
            for c in ready:
                w = conns.index(c)
                try:
                    msg = c.recv()
                except EOFError:
                    procs[w].join(5)
                    raise RuntimeError(f"grid worker {w} died (exit code {procs[w].exitcode})") from None
                if msg[0] == "waiting":
                    waiting.setdefault(w, time.perf_counter())
                elif msg[0] == "requests":
                    waiting.pop(w, None)
                    pending.extend((c, ticket, policy, obs, seed) for ticket, policy, obs, seed in msg[1])
                elif msg[0] == "result":
                    results[msg[1]][msg[2].seed] = msg[2]
                    done = len(results[msg[1]])
                    if done == len(seeds):
                        if progress:
                            progress(f"{cells[msg[1]].name}: {sum(r.success for r in results[msg[1]].values())}/"
                                     f"{done} ({time.perf_counter() - t0:.0f} s)")
                        if on_cell is not None:  # written now: a run killed later keeps its finished cells
                            on_cell(msg[1], [results[msg[1]][s] for s in seeds])
                elif msg[0] == "done":  # its last episodes may have ended with requests still in flight
                    live.discard(w)
                    waiting.pop(w, None)
                    kept = [item for item in pending if item[0] is not c]
                    pending.clear()
                    pending.extend(kept)
                elif msg[0] == "crash":
                    raise RuntimeError(f"grid worker {w} failed:\n{msg[1]}")
            if should_serve(len(pending), live, waiting, max_batch, time.perf_counter()):
                for conn in _serve_batch(pending, backends or {}, max_batch, batches, batch_ms, stage_ms):
                    waiting.pop(conns.index(conn), None)
            if budget_s is not None and not stopped and time.perf_counter() - t0 > budget_s:
                stopped = True
                for w in live:
                    conns[w].send(("stop",))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    ordered = {ci: [res[s] for s in seeds if s in res] for ci, res in results.items()}
    return GridRun(ordered, time.perf_counter() - t0, batches, batch_ms, stopped, stage_ms)


def should_serve(pending: int, live: set[int], waiting: dict[int, float], max_batch: int, now: float) -> bool:
    """Serve once every live worker waits on a reply (no more requests can come), when a full batch is there, or
    when a worker has waited MERGE_WAIT_S (one stepping slowly is not waited for); never while none waits."""
    if not pending:
        return False
    if live <= waiting.keys() or pending >= max_batch:
        return True
    return bool(waiting) and now - min(waiting.values()) >= MERGE_WAIT_S


def _serve_batch(pending: deque, backends: dict[str, Any], max_batch: int, batches: list[int],
                 batch_ms: list[float], stage_ms: list[dict[str, float]]) -> list[Connection]:
    """One policy call for up to max_batch requests of the oldest request's policy; replies to their workers (the
    connections it replied to are returned)."""
    policy = pending[0][2]
    take, keep = [], deque()
    while pending:
        item = pending.popleft()
        (take if item[2] == policy and len(take) < max_batch else keep).append(item)
    pending.extend(keep)
    t0 = time.perf_counter()
    backend = backends.get(policy)
    if backend is None:
        out: list[Any] = [f"no policy {policy!r} in this grid (--trained-policy?)"] * len(take)
    else:
        try:
            out = backend.infer_batch([it[3] for it in take], [it[4] for it in take])
        except Exception as e:  # noqa: BLE001  every lane of the batch sees the failure
            out = [e] * len(take)
    batch_ms.append((time.perf_counter() - t0) * 1e3)
    batches.append(len(take))
    if (stages := getattr(backend, "last_stage_ms", None)) is not None:
        stage_ms.append(stages)
        backend.last_stage_ms = None
    by_conn: dict[Connection, dict[int, Any]] = {}
    for (conn, ticket, *_), rows in zip(take, out, strict=True):
        by_conn.setdefault(conn, {})[ticket] = (f"{type(rows).__name__}: {rows}" if isinstance(rows, Exception)
                                                else rows)
    for conn, replies in by_conn.items():
        try:
            conn.send(("replies", replies))
        except (BrokenPipeError, ConnectionResetError):  # the worker finished: nothing waits for these replies
            pass
    return list(by_conn)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
