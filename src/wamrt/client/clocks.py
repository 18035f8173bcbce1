"""The two clocks of `RealtimeRunner`: real time (a robot, a server) and simulated time (seeded delays).

A clock owns the request in flight: `submit(request, call)` starts it, `arrived(step)` returns its reply (or the
exception it raised) once it has arrived by control step `step`, `flush()` makes sure a reply due now exists,
`tick()` starts a control step. At most one request is in flight per runner.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CONTROL_HZ = 15.0
Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True)
class LatencyModel:
    """Per-request delay in control steps: `steps` fixed, or a latency in ms (fixed `p50_ms`, or log-normal
    through `p50_ms` and `p99_ms`) counted in steps as d = ceil(latency / control period), so a 49 ms request is
    d = 1 and a 606 ms one d = 10 at 15 Hz. Draws are a pure function of (episode seed, request index)."""

    steps: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    control_hz: float = CONTROL_HZ
    source: str | None = None  # the result file the latencies came from, if any

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.p50_ms is None):
            raise ValueError("give either a fixed delay in steps or a latency p50 in ms")
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"delay steps must be >= 0, got {self.steps}")
        if self.p50_ms is not None and not (np.isfinite(self.p50_ms) and self.p50_ms >= 0):
            raise ValueError(f"latency p50 must be a finite number of ms >= 0, got {self.p50_ms}")
        if self.p99_ms is not None and not (np.isfinite(self.p99_ms) and self.p99_ms >= (self.p50_ms or 0.0)):
            raise ValueError(f"latency p99 must be a finite number of ms >= p50, got {self.p99_ms}")

    @classmethod
    def parse(cls, text: str, control_hz: float = CONTROL_HZ) -> LatencyModel:
        """"P50" or "P50,P99" (ms), or a result file with p50_ms / p99_ms (`wamrt bench load` or `latency`)."""
        path = Path(text)
        if path.suffix == ".json" or path.is_file():
            try:
                res = json.loads(path.read_text())
                return cls(p50_ms=float(res["p50_ms"]), p99_ms=float(res["p99_ms"]), control_hz=control_hz,
                           source=str(path))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"cannot read p50_ms / p99_ms from {path}: {e}") from e
        parts = text.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError as e:
            raise ValueError(f"latency must be P50[,P99] in ms or a result file, got {text!r}") from e
        if len(values) not in (1, 2):
            raise ValueError(f"latency must be P50[,P99] in ms, got {text!r}")
        return cls(p50_ms=values[0], p99_ms=values[1] if len(values) == 2 else None, control_hz=control_hz)

    @property
    def period_ms(self) -> float:
        return 1000.0 / self.control_hz

    def steps_for(self, latency_ms: float) -> int:
        return max(0, math.ceil(latency_ms / self.period_ms - 1e-9))

    def latency_ms(self, episode_seed: int, index: int) -> float | None:
        if self.p50_ms is None:
            return None
        if self.p99_ms is None or self.p99_ms == self.p50_ms or self.p50_ms == 0:
            return self.p50_ms
        sigma = math.log(self.p99_ms / self.p50_ms) / Z99
        z = np.random.default_rng([int(episode_seed), int(index), 0x1A7E]).standard_normal()
        return float(self.p50_ms * math.exp(sigma * z))

    def delay(self, episode_seed: int, index: int) -> int:
        if self.steps is not None:
            return self.steps
        ms = self.latency_ms(episode_seed, index)
        assert ms is not None
        return self.steps_for(ms)

    def nominal_steps(self) -> int:
        """The delay at the median: what a table calls this model's d."""
        return self.steps if self.steps is not None else self.steps_for(self.p50_ms or 0.0)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"delay_steps": self.nominal_steps(), "control_hz": self.control_hz}
        if self.p50_ms is not None:
            out["latency_ms"] = {"p50": self.p50_ms, "p99": self.p99_ms, "model": "fixed" if self.p99_ms is None
                                 else "log-normal through p50 and p99", "source": self.source}
        return out


class SimClock:
    """Simulated time: a request sent at step t arrives at t + d, d drawn by `latency` for (episode, request).
    The policy is called lazily, when the reply is first needed, so a harness may batch the calls of many
    lanes (`call` may be a handle into a shared batch); replies are the same whenever they are computed."""

    replays = True  # episodes are pure functions of their seed: the runner resets its delay estimate per episode

    def __init__(self, latency: LatencyModel | int = 0) -> None:
        self.latency = LatencyModel(steps=latency) if isinstance(latency, int) else latency
        self.episode_seed = 0
        self._pending: tuple[int, Callable[[], Any]] | None = None
        self._reply: Any = None
        self.drawn_ms: list[float] = []  # per request, where the model draws latencies in ms

    def start(self, episode_seed: int | None) -> None:
        self.episode_seed = int(episode_seed or 0)
        self._pending, self._reply = None, None
        self.drawn_ms = []

    def submit(self, request: Any, call: Callable[[], Any]) -> None:
        ms = self.latency.latency_ms(self.episode_seed, request.index)
        if ms is not None:
            self.drawn_ms.append(ms)
        self._pending = (request.step + self.latency.delay(self.episode_seed, request.index), call)
        self._reply = None

    def flush(self) -> None:
        """Nothing to do: `arrived` computes a due reply itself."""

    def arrived(self, step: int) -> Any:
        if self._pending is None or step < self._pending[0]:
            return None
        call = self._pending[1]
        self._pending = None
        try:
            return call()
        except Exception as e:  # noqa: BLE001  handed to the runner, which raises or logs it
            return e

    def tick(self) -> None:
        pass


class WallClock:
    """Real time at `control_hz`: `tick` sleeps until the next period starts (a late step is counted, never
    made up for), each request runs in a background thread, and a reply counts as arrived at the first tick
    after it is done. `sleep` and `now` can be replaced (tests drive a fake clock)."""

    replays = False

    def __init__(self, control_hz: float = CONTROL_HZ, *, sleep: Callable[[float], None] = time.sleep,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.period_s = 1.0 / control_hz
        self.sleep, self.now = sleep, now
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="realtime-request")
        self._future: Future | None = None
        self._sent_at = 0.0
        self.latencies_ms: list[float] = []  # per request: send -> reply done
        self.overruns = 0  # ticks that started after their period had already passed
        self._next: float | None = None
        self._lock = threading.Lock()

    def start(self, episode_seed: int | None) -> None:
        """A new episode: a request still running from the last one is waited out (its reply is dropped), so the
        next episode's first request does not queue behind it."""
        if self._future is not None:
            with contextlib.suppress(Exception):
                self._future.result()
            self._future = None
        with self._lock:
            self.latencies_ms.clear()
        self._next = None
        self.overruns = 0

    def submit(self, request: Any, call: Callable[[], Any]) -> None:
        sent = self.now()

        def run() -> Any:
            try:
                return call()
            finally:
                with self._lock:
                    self.latencies_ms.append((self.now() - sent) * 1e3)

        self._future = self._pool.submit(run)

    def flush(self) -> None:
        pass

    def arrived(self, step: int) -> Any:
        f = self._future
        if f is None or not f.done():
            return None
        self._future = None
        return f.exception() or f.result()

    def tick(self) -> None:
        """Wait for the next control period to start (the first tick starts the schedule at once)."""
        now = self.now()
        if self._next is None:
            self._next = now + self.period_s
            return
        wait = self._next - now
        if wait > 0:
            self.sleep(wait)
            self._next += self.period_s
        else:
            self.overruns += 1
            self._next = now + self.period_s  # late: this period starts now (no burst of catch-up ticks)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
