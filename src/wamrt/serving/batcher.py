"""Dynamic batcher: the one bridge between the event loop and the single engine worker thread.

Requests with the same bucket key (the resolved sampler overrides; every DROID observation becomes the
same 540x640 canvas, so the overrides are what separates `infer_batch` calls) are grouped into one
`policy.infer_batch` call of at most `max_batch` items, waiting at most `max_wait_ms` after the first
one arrived. The queue is bounded: over `max_queue` waiting jobs, `submit` raises `Busy` at once.

The event loop never runs model work: it only enqueues and awaits a `concurrent.futures.Future`.
A client that goes away cancels its future; a job still waiting is dropped from the queue right then
(no stuck job), a job already running finishes and its result is discarded.

A job may instead carry a `task` (a callable, e.g. a forward/inverse-dynamics request): it goes through
the same bounded queue and the same engine thread, but always alone (different shapes, no batching).

The device is shared with world-generation jobs (`generation.py`), which run on their own thread through
`DeviceGate`: every job of this queue counts as demand from the moment it is queued until its future is
done, and generation only takes the device, one denoising step at a time, while that demand is zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..pipeline.droid import ActionChunk
from .errors import Busy, NotReady, StaleObservation

log = logging.getLogger("wamrt.serving")


class BatchPolicy(Protocol):
    def infer_batch(self, observations: list[Mapping[str, Any]], *, seeds: list[int | None] | None = None,
                    **overrides: Any) -> list[ActionChunk | Exception]: ...

    def metadata(self) -> dict[str, Any]: ...


@dataclass
class BatchResult:
    chunk: ActionChunk  # for a `task` job: whatever the task returned
    queue_ms: float  # submit -> batch start
    batch_ms: float  # wall time of the infer_batch call this request rode in
    batch_size: int


@dataclass
class Job:
    observation: Mapping[str, Any]
    seed: int | None
    overrides: dict[str, Any]
    deadline: float | None = None  # monotonic
    enqueued: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    task: Callable[[], Any] | None = None  # run alone on the engine thread instead of infer_batch

    @property
    def key(self) -> Hashable:
        if self.task is not None:
            return ("task", id(self))  # never shares a batch
        return tuple(sorted(self.overrides.items()))


class GenerationCancelled(Exception):
    """A generation job was cancelled (DELETE, or its /sync client left) while it waited for the device."""


class DeviceGate:
    """Who runs model work next: queued policy work first, world generation only in the gaps.

    The engine thread wraps every batch / task in `policy()`; it waits only for a generation segment (one
    denoising step, or the prefill / decode before and after the loop) already running to end. The
    generation thread holds the device with `acquire_generation()` / `release_generation()` per segment
    and does not start another while any policy job is queued or running (`demand`). A policy request
    therefore waits at most one generation segment, and generation uses the device only when the queue is
    empty: under saturating policy traffic it makes no progress (by design; its own queue is bounded).
    The Reasoner's decode thread (`chat_worker`) takes its segments (a prefill, a decode step) the same way; it and
    generation take turns.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.demand = 0  # policy-queue jobs queued or running
        self._policy_running = False
        # Background segments held now (0 or 1): world generation and the Reasoner's decode thread (`chat_worker`) take
        # turns, so the device runs one of the three kinds of work at a time (a CUDA-graph capture on one thread
        # never meets another thread's kernels).
        self._generation_holders = 0
        self.generation_since: float | None = None  # monotonic start of the background segment holding the device
        self.generation_waits = 0  # segments that waited for policy work (test / metrics hook)

    def add_demand(self, n: int) -> None:
        with self._cond:
            self.demand += n
            if self.demand <= 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def policy(self) -> Iterator[None]:
        with self._cond:
            while self._generation_holders:
                self._cond.wait()
            self._policy_running = True
        try:
            yield
        finally:
            with self._cond:
                self._policy_running = False
                self._cond.notify_all()

    def acquire_generation(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Block until no policy work is queued or running, then hold the device for one segment. Raises
        `GenerationCancelled` as soon as `cancelled()` turns true while waiting."""
        with self._cond:
            waited = False
            while self.demand > 0 or self._policy_running or self._generation_holders:
                if cancelled():
                    raise GenerationCancelled("cancelled while waiting for the device")
                waited = True
                self._cond.wait(0.05)
            if cancelled():
                raise GenerationCancelled("cancelled")
            self._generation_holders += 1
            self.generation_since = time.monotonic()
            self.generation_waits += waited

    def release_generation(self) -> None:
        with self._cond:
            self._generation_holders -= 1
            if not self._generation_holders:
                self.generation_since = None
            self._cond.notify_all()


class BatchObserver(Protocol):
    def queue_depth(self, depth: int) -> None: ...

    def batch(self, size: int, seconds: float) -> None: ...


class Batcher:
    def __init__(self, policy: BatchPolicy, *, max_batch: int = 8, max_wait_ms: float = 5.0, max_queue: int = 64,
                 observer: BatchObserver | None = None) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_ms >= 0")
        self.policy, self.max_batch, self.max_wait = policy, max_batch, max_wait_ms / 1e3
        self.max_queue, self.observer = max_queue, observer
        self.gate = DeviceGate()
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.in_flight = 0
        self.running_since: float | None = None  # monotonic start of the batch / task on the engine (readiness)
        self.batches_run = 0
        self._thread = threading.Thread(target=self._worker, name="wamrt-engine", daemon=True)
        self._thread.start()

    # --- event-loop side ---------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._pending)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._stopped:
                raise NotReady("server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise Busy(f"queue full ({self.max_queue} waiting); retry later")
            self._pending.append(job)
            self.gate.add_demand(1)
            self._notify_depth()
            self._cond.notify_all()
        # A weak reference: the future keeps its callbacks after it is done, so a callback holding the job would
        # make a job <-> future cycle that keeps the observation (megabytes) until a full collection.
        ref = weakref.ref(job)
        job.future.add_done_callback(lambda f: f.cancelled() and (j := ref()) is not None and self._discard(j))
        job.future.add_done_callback(lambda _f: self.gate.add_demand(-1))  # exactly once, however it ends
        return job.future

    async def run(self, job: Job) -> BatchResult:
        """Submit and await; cancelling the awaiting task cancels the job (if it has not started)."""
        return await asyncio.wrap_future(self.submit(job))

    def _discard(self, job: Job) -> None:
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return  # already taken by the worker
            self._notify_depth()

    def _notify_depth(self) -> None:
        if self.observer:
            self.observer.queue_depth(len(self._pending))

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            leftover = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in leftover:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(NotReady("server is shutting down"))
        self._thread.join(timeout)

    # --- engine thread -----------------------------------------------------------------------------
    def _take_batch(self) -> list[Job] | None:
        with self._cond:
            while True:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return None
                first = self._pending[0]
                if first.task is not None:  # runs alone: no companions to wait for
                    self._pending.popleft()
                    self._notify_depth()
                    return [first]
                until = first.enqueued + self.max_wait
                # Wait for companions of the same bucket, but never past the first job's max wait.
                while (sum(j.key == first.key for j in self._pending) < self.max_batch
                       and (left := until - time.monotonic()) > 0 and not self._stopped):
                    self._cond.wait(left)
                if not self._pending:
                    continue  # everyone cancelled meanwhile
                key = self._pending[0].key
                batch = [j for j in self._pending if j.key == key][: self.max_batch]
                for j in batch:
                    self._pending.remove(j)
                self._notify_depth()
                return batch

    def _worker(self) -> None:
        while (batch := self._take_batch()) is not None:
            self._process(batch)
            del batch  # hold no finished job (nor its observation) while waiting for the next one

    def _process(self, batch: list[Job]) -> None:
        # The device first (a generation segment may still hold it), then who is still there: a client that
        # left meanwhile costs no engine work.
        with self.gate.policy():
            now = time.monotonic()
            live: list[Job] = []
            for job in batch:
                if not job.future.set_running_or_notify_cancel():
                    continue  # client left while queued
                if job.deadline is not None and now > job.deadline:
                    job.future.set_exception(StaleObservation("observation expired while queued"))
                    continue
                live.append(job)
            if live:
                self.running_since = now
                try:
                    self._run(live, now)
                finally:
                    self.running_since = None

    def _run(self, jobs: list[Job], start: float) -> None:
        if jobs[0].task is not None:
            self._run_task(jobs[0], start)
            return
        self.in_flight = len(jobs)
        try:
            results: list[Any] = self.policy.infer_batch(
                [j.observation for j in jobs], seeds=[j.seed for j in jobs], **jobs[0].overrides)
            if len(results) != len(jobs):
                raise RuntimeError(f"infer_batch returned {len(results)} results for {len(jobs)} requests")
        except Exception as exc:  # the engine failed as a whole: every rider gets the error
            log.exception("infer_batch failed")
            results = [exc] * len(jobs)
        elapsed = time.monotonic() - start
        self.in_flight = 0
        self.batches_run += 1
        if self.observer:
            self.observer.batch(len(jobs), elapsed)
        for job, res in zip(jobs, results, strict=True):
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(BatchResult(res, 1e3 * (start - job.enqueued), 1e3 * elapsed, len(jobs)))

    def _run_task(self, job: Job, start: float) -> None:
        assert job.task is not None
        self.in_flight = 1
        try:
            result = job.task()
        except Exception as exc:  # noqa: BLE001  # the task's own error goes to its caller
            job.future.set_exception(exc)
        else:
            job.future.set_result(BatchResult(result, 1e3 * (start - job.enqueued),
                                              1e3 * (time.monotonic() - start), 1))
        finally:
            self.in_flight = 0
            self.batches_run += 1
