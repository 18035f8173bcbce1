"""The Reasoner's decode thread: chat requests (and the prompt upsampling of generation jobs) decoded together, one
token per live request per step, on the device the policy queue and world generation share.

Scheduling is generation's (`batcher.DeviceGate`): every prefill and every decode step is one segment, taken only
while no policy work is queued or running, so a policy request waits at most one segment (a decode step is a few
milliseconds at Nano; a prefill is one forward over the prompt). Requests join the running batch between steps
(continuous batching) into free rows of one K/V cache, allocated at the first request; a request that leaves (its
client hung up) frees its row at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..pipeline.errors import RequestError
from .batcher import DeviceGate
from .errors import Busy, NotReady, ServingError, as_serving_error

log = logging.getLogger("wamrt.serving")


@dataclass
class ChatUpdate:
    """What one step gives a request: new final text, and on its last update the finish reason (or an error)."""

    text: str = ""
    tokens: int = 0  # completion tokens so far
    finish_reason: str | None = None
    error: ServingError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class ChatJob:
    def __init__(self, prompt: Any, params: Any, sink: Callable[[ChatUpdate], None], request_id: str = "") -> None:
        self.prompt, self.params, self.sink, self.request_id = prompt, params, sink, request_id
        self.cancelled = threading.Event()
        self.seq: Any = None
        self.enqueued = time.monotonic()


class ChatWorker:
    """precapture_when: None, or a callable that turns true once the server may spend idle device time on the
    decode graphs (after warm-up and the policy's own captures). From then on, while no chat runs or waits, the
    thread captures every (rows, span) bucket of the decode graphs ahead of use, one bucket per device segment,
    so no chat request's step captures (a capture is a few decode steps plus recording: a long segment for a
    policy request to wait behind)."""

    def __init__(self, reasoner: Any, gate: DeviceGate, *, max_batch: int, max_queue: int,
                 on_first_token: Callable[[float], None] | None = None,
                 precapture_when: Callable[[], bool] | None = None, one_row: bool = False) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        # one_row (`--chat-decode one-row`): steps of one request on `reasoner.fused.OneRowDecode`, on the model's
        # own matrices (nothing fused or folded: the policy shares them), nothing compiled; where it cannot run this
        # model, the layers, said once in the log
        self.decode_options: dict[str, Any] = {}
        if one_row:
            from ..reasoner.fused import OneRowDecode

            problem = OneRowDecode.problem(reasoner.lm)
            if problem:
                log.warning("chat: --chat-decode one-row cannot run this model (%s); decoding with its layers", problem)
            else:
                self.decode_options = {"one_row": True}
        self.reasoner, self.gate, self.max_batch, self.max_queue = reasoner, gate, max_batch, max_queue
        self.on_first_token = on_first_token  # seconds from queued to the first token (Metrics.first_token)
        self.batch: Any = None  # DecodeBatch, made on the first request or for the first precapture
        self.precapture_when = precapture_when
        self._to_capture: list[tuple[int, int]] | None = None  # planned at the first precapture
        self.graphs_planned = self.graphs_precaptured = 0
        self._pending: deque[ChatJob] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.steps = self.tokens = self.requests = 0
        self.device_seconds, self.segment_max_ms = 0.0, 0.0
        self._thread = threading.Thread(target=self._loop, name="wamrt-reasoner", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return 0 if self.batch is None else len(self.batch.live)

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "steps": self.steps, "tokens": self.tokens, "running": self.running,
                "queued": self.depth, "device_seconds": self.device_seconds,
                "segment_max_seconds": self.segment_max_ms / 1e3,
                "graphs": {"planned": self.graphs_planned, "precaptured": self.graphs_precaptured,
                           "captured_on_request": 0 if self.batch is None else self.batch.captures_on_step}}

    def submit(self, job: ChatJob) -> None:
        with self._cond:
            if self._stopped:
                raise NotReady("server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise Busy(f"{self.max_queue} chat requests are waiting; retry later")
            self._pending.append(job)
            self._cond.notify_all()

    def cancel(self, job: ChatJob) -> None:
        """The client left: a queued job leaves the queue now, a running one frees its row before the next step."""
        job.cancelled.set()
        with self._cond:
            with contextlib.suppress(ValueError):
                self._pending.remove(job)
            self._cond.notify_all()

    def run(self, prompt: Any, params: Any, *, cancelled: Callable[[], bool] = lambda: False
            ) -> tuple[str, str, int]:
        """Blocking: one prompt to its end from another thread (a generation job's upsampling) ->
        (text, finish reason, completion tokens). Raises the job's error; `cancelled()` turning true (the generation
        job was cancelled) drops it and raises `GenerationCancelled`."""
        from .batcher import GenerationCancelled

        done, parts, last = threading.Event(), [], [ChatUpdate()]

        def sink(update: ChatUpdate) -> None:
            parts.append(update.text)
            last[0] = update
            if update.done:
                done.set()

        job = ChatJob(prompt, params, sink)
        self.submit(job)
        while not done.wait(0.05):
            if cancelled():
                self.cancel(job)
                raise GenerationCancelled("cancelled while upsampling its prompt")
        if last[0].error is not None:
            raise last[0].error
        return "".join(parts), str(last[0].finish_reason), last[0].tokens

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the decode thread ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _device(self) -> Iterator[None]:
        self.gate.acquire_generation()
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.gate.release_generation()
            self.device_seconds += took
            self.segment_max_ms = max(self.segment_max_ms, 1e3 * took)

    def _loop(self) -> None:
        from ..reasoner.engine import DecodeBatch

        while True:
            with self._cond:
                while not self._stopped and not self._pending and not (self.batch is not None and self.batch.live):
                    if self._precapture_pending() and self.precapture_when():
                        break
                    self._cond.wait(timeout=0.5 if self._precapture_pending() else None)
                if self._stopped:
                    break
                idle = not self._pending and not (self.batch is not None and self.batch.live)
            if idle:  # woken for a precapture
                self._precapture_one(DecodeBatch)
                continue
            try:
                if self.batch is None:
                    self.batch = DecodeBatch(self.reasoner, self.max_batch, **self.decode_options)
                self._drop_cancelled()
                self._admit()
                if self.batch.live:
                    with self._device():
                        # The next step is launched before this one's tokens are read (the GPU never waits for
                        # the host between steps) unless policy work is waiting: it then gets the device as soon as
                        # this step's kernels end, not after one more.
                        events = self.batch.step(lookahead=not self.gate.demand)
                    self.steps += 1
                    self._deliver(events)
            except Exception as exc:  # noqa: BLE001  # a failed step fails its requests, not the thread
                log.exception("reasoner step failed")
                self._fail_live(as_serving_error(exc))
        self._shutdown()

    def _precapture_pending(self) -> bool:
        return self.precapture_when is not None and (self._to_capture is None or bool(self._to_capture))

    def _precapture_one(self, decode_batch: Any) -> None:
        """Capture the next planned bucket (planning them first), in one device segment; a failure ends the
        precaptures (steps then capture on first use, as without them)."""
        try:
            if self._to_capture is None:
                if self.batch is None:  # the K/V cache the memory plan reserved for chat, allocated now
                    with self._device():
                        self.batch = decode_batch(self.reasoner, self.max_batch, **self.decode_options)
                self._to_capture = self.batch.graph_buckets()  # none without CUDA graphs
                self.graphs_planned = len(self._to_capture)
                if self._to_capture:
                    log.info("chat: capturing %d decode graphs while idle", self.graphs_planned)
                return
            rows, span = self._to_capture.pop(0)
            with self._device():
                self.graphs_precaptured += self.batch.precapture(rows, span)
        except Exception:  # noqa: BLE001  speed, not correctness, is lost
            log.exception("chat: capturing the decode graphs ahead of use failed; steps capture on first use")
            self._to_capture = []

    def _drop_cancelled(self) -> None:
        for seq in list(self.batch.live):
            if seq.tag.cancelled.is_set():
                self.batch.cancel(seq)

    def _admit(self) -> None:
        while self.batch.free_rows:
            with self._cond:
                if not self._pending:
                    return
                job = self._pending.popleft()
            if job.cancelled.is_set():
                continue
            self.requests += 1
            try:
                with self._device():
                    event = self.batch.admit(job.prompt, job.params, tag=job)
            except RequestError as exc:
                job.sink(ChatUpdate(error=as_serving_error(exc)))
                continue
            job.seq = event.seq
            if self.on_first_token is not None:
                self.on_first_token(time.monotonic() - job.enqueued)
            self._deliver([event])

    def _deliver(self, events: list[Any]) -> None:
        for e in events:
            self.tokens += 1
            job = e.seq.tag
            if not job.cancelled.is_set():
                job.sink(ChatUpdate(e.text, len(e.seq.tokens), e.finish_reason))

    def _fail_live(self, err: ServingError) -> None:
        if self.batch is None:
            return
        for seq in list(self.batch.live):
            self.batch.cancel(seq)
            seq.tag.sink(ChatUpdate(error=err))

    def _shutdown(self) -> None:
        err = NotReady("server is shutting down")
        with self._cond:
            leftover = list(self._pending)
            self._pending.clear()
        for job in leftover:
            job.sink(ChatUpdate(error=err))
        self._fail_live(err)
