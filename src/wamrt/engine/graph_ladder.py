"""Captures off the request path: one thread that captures, one bucket at a time, the buckets a server plans (its
batch ladder at every prefix-width rung) and those requests wanted, while the request path serves without them
(`GraphCapture._graph_loop`: a compatible wider graph, replays of smaller ones, or uncaptured).

The thread shares no mutable engine state with the request path but the graph cache (locked): its K/V arena cursor
is its own (`KVBufferArena`, per thread), a capture's warm-up runs use fresh buffers, it captures in thread-local
mode (the request path keeps launching and allocating meanwhile) and it starts from inputs a request left behind
(`LoopInputs`: latents and cached, immutable Reasoner K/V).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch

from ..ops.capture_turn import empty_cache
from .graph_cache import GraphKey
from .graph_capture import LoopInputs
from .kv_buffers import BatchBranch
from .prefix_cache import StackedKV, kv_storage

log = logging.getLogger(__name__)

MAX_PENDING = 64  # buckets waiting for a capture; requests wanting more run without graphs until one frees


class CaptureWorker:
    """The background capture thread of one engine (`Engine.want_bucket` starts it on first use)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pending: OrderedDict[GraphKey, LoopInputs] = OrderedDict()
        self._planned: list[GraphKey] = []
        self.failed: dict[GraphKey, str] = {}
        self.capturing: GraphKey | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.started_at: float | None = None
        self.complete_at: float | None = None  # when the last planned bucket was captured (or failed)

    def want(self, key: GraphKey, inputs: LoopInputs, *, planned: bool = False) -> None:
        """Queue `key` for capture from `inputs` (a batch that wanted it), unless held, queued or failed before."""
        with self._cond:
            if planned and key not in self._planned:
                self._planned.append(key)
                self.complete_at = None
            if key in self.engine.graphs or key in self._pending or key == self.capturing or key in self.failed:
                return
            if len(self._pending) >= MAX_PENDING and not planned:
                return
            self._pending[key] = inputs
            self._cond.notify_all()
        self.start()

    def start(self) -> None:
        with self._cond:
            if self._thread is None and not self._stopped:
                self.started_at = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="wamrt-capture", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        with self._cond:
            self._stopped = True
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every planned bucket is captured (or failed); False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._complete():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _complete(self) -> bool:
        """Every planned bucket captured (or failed), and nothing else queued or under way."""
        return (not self._pending and self.capturing is None
                and all(k in self.engine.graphs or k in self.failed for k in self._planned))

    def progress(self) -> dict[str, Any]:
        with self._cond:
            done = sum(k in self.engine.graphs for k in self._planned)
            failed = len(self.failed)  # planned or wanted by a request
            seconds = None
            if self.started_at is not None:
                seconds = round((self.complete_at or time.monotonic()) - self.started_at, 1)
            return {"planned": len(self._planned), "captured": done, "failed": failed, "pending": len(self._pending),
                    "capturing": None if self.capturing is None else self.capturing.describe(),
                    "complete": self._complete(), "seconds": seconds,
                    "errors": [f"{k.describe()}: {e}" for k, e in list(self.failed.items())[-3:]]}

    def _run(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)  # the current device is per thread
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                key, inputs = self._pending.popitem(last=False)
                if key in self.engine.graphs:
                    continue
                self.capturing = key
            try:
                with torch.inference_mode():
                    self.engine.capture_bucket(key, inputs)
            except Exception as exc:  # noqa: BLE001  # an out-of-memory or a failed capture: requests keep running
                log.warning("background capture of %s failed: %s: %s", key.describe(), type(exc).__name__, exc)
                with self._cond:
                    self.failed[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if isinstance(exc, torch.OutOfMemoryError):
                    empty_cache()
            with self._cond:
                self.capturing = None
                if self.complete_at is None and self._complete():
                    self.complete_at = time.monotonic()
                self._cond.notify_all()


def _within(inputs: LoopInputs, width: int | None) -> LoopInputs:
    """`inputs` with every Reasoner prefix cut to its last `width` tokens: a capture needs the shapes only (a replay
    copies each request's own prefixes in), and a narrow rung must be captured from a longer instruction too."""
    if width is None:
        return inputs

    def cut(seqs: list[BatchBranch]) -> list[BatchBranch]:
        return [s if s.kv.length <= width else
                BatchBranch(s.request, StackedKV.over(kv_storage(s.kv)[..., -width:, :]), s.rope) for s in seqs]

    return replace(inputs, conds=cut(inputs.conds), unconds=cut(inputs.unconds))


class BackgroundCapture:
    """The engine's side of captures off the request path (a part of `Engine`, like `GraphCapture`): buckets wanted
    by requests or planned by a server, captured by the `CaptureWorker` thread."""

    _capture_worker: CaptureWorker | None
    _last_inputs: LoopInputs | None = None  # the last batch that wanted a bucket: a ladder's template

    def want_bucket(self, key: GraphKey, inputs: LoopInputs, *, planned: bool = False) -> None:
        """Have `key` captured in the background from `inputs` (a batch of its shape, prefixes exact)."""
        self._last_inputs = inputs
        if self._capture_worker is None:
            self._capture_worker = CaptureWorker(self)
        self._capture_worker.want(key, inputs, planned=planned)

    def capture_bucket(self, key: GraphKey, inputs: LoopInputs) -> None:
        """Capture `key`'s graph from `inputs`, grown to its rows and padded to its width (the background thread)."""
        if key in self.graphs:  # type: ignore[attr-defined]
            return
        if key.bucketed:
            x_v, x_a, static, conds, unconds = self._fit_rows(  # type: ignore[attr-defined]
                key, inputs.x_v, inputs.x_a, inputs.static, inputs.conds, inputs.unconds)
        else:  # exact lengths: the inputs are the bucket's own
            x_v, x_a, conds, unconds, static = inputs.x_v, inputs.x_a, inputs.conds, inputs.unconds, inputs.static
        self._capture_timed(key, x_v, x_a, static, conds, unconds, inputs.plan,  # type: ignore[attr-defined]
                            inputs.timesteps, inputs.cfg_steps, inputs.opts, inputs.raw_dim, cause="background")

    def plan_ladder(self, inputs: LoopInputs | None = None) -> list[GraphKey]:
        """Queue every bucket of the batch ladder at every prefix-width rung for the background thread, in the order
        a server needs them: batch 1 first (every batch can run on it, one request after the other), the widest
        prefix first at each batch size (it holds every instruction). `inputs`: a batch of the sampler pattern to
        capture (default: the last batch that wanted a bucket). Returns the planned keys."""
        template = inputs or self._last_inputs
        if template is None:
            raise ValueError("plan_ladder needs a batch's inputs: serve one request first")
        widths = self._width_rungs() or [None]  # type: ignore[attr-defined]
        planned: dict[GraphKey, LoopInputs] = {}
        for batch in sorted(set(self.config.batch_ladder) | {1}):  # type: ignore[attr-defined]
            for width in reversed(widths):
                one = _within(template.rows(0, 1), width)
                conds, unconds = (self._pad_prefixes(one.conds, one.unconds, width=width)  # type: ignore[attr-defined]
                                  if self.config.prompt_bucket else (one.conds, one.unconds))  # type: ignore[attr-defined]
                key = self._graph_key(one.x_v, one.x_a, conds, unconds, one.timesteps,  # type: ignore[attr-defined]
                                      one.cfg_steps, one.opts, one.raw_dim)
                planned.setdefault(key.rows(batch) if key.bucketed else key, one)
        for key, inputs in planned.items():
            self.want_bucket(key, inputs, planned=True)
        self._last_inputs = template
        return list(planned)

    def capture_progress(self) -> dict[str, Any]:
        """The background captures: planned, captured, failed, pending, complete, seconds since the first."""
        if self._capture_worker is None:
            return {"planned": 0, "captured": 0, "failed": 0, "pending": 0, "capturing": None, "complete": True,
                    "seconds": None, "errors": []}
        return self._capture_worker.progress()

    def wait_for_captures(self, timeout: float | None = None) -> bool:
        """Block until every planned bucket is captured (or failed); False on timeout."""
        return self._capture_worker is None or self._capture_worker.wait(timeout)

    def stop_background_capture(self) -> None:
        if self._capture_worker is not None:
            self._capture_worker.stop()
