"""One CUDA graph capture at a time in a process: the turn every capture (and the warm-up runs before it) takes.

Every capture here is thread-local, so another thread may launch kernels and allocate while one records. That is
not enough when two threads capture: `torch.cuda.graph` begins with a device-wide synchronize and `empty_cache`,
which CUDA refuses while any stream of the device is capturing (`cudaErrorStreamCaptureUnsupported`), and the
refusal also invalidates the capture under way. The warm-up before a capture is no safer: a first run compiles, and
Inductor's and Triton's benchmarks synchronize the device. On an H100 (2026-12-06) a server's i2v warm-up job
captured its segments while the background ladder captured a policy graph, and both failed; the server never
turned ready. So whoever warms up and captures holds the turn, and so does an `empty_cache` that can run
while a server answers; code that may run beside a capture synchronizes its own stream, never the device.

A thread that holds the device for others (a world job, which hands the device to policy batches between its
segments) must not hold the turn while it waits for the device back: `wait` callbacks run with the turn let go.

One more hazard of compiling beside other threads: `prime_compiler_for_threads`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_TURN = threading.RLock()


def _take(wait: Callable[[], None] | None) -> None:
    if wait is None:
        _TURN.acquire()
        return
    while not _TURN.acquire(timeout=0.002):
        wait()  # e.g. hand the device to a waiting policy batch while another thread captures


class Turn:
    """The turn, held by this thread (`capture_turn`)."""

    def __init__(self, wait: Callable[[], None] | None) -> None:
        self.wait, self.held = wait, True

    @contextmanager
    def let_go(self) -> Iterator[None]:
        """Let the turn go for the block (between two captures, while the device goes to other work), then take it
        back. (If taking it back raises -- `wait` cancelling a job -- the turn stays let go.)"""
        _TURN.release()
        self.held = False
        yield
        _take(self.wait)
        self.held = True


@contextmanager
def capture_turn(wait: Callable[[], None] | None = None) -> Iterator[Turn]:
    """Hold the process's capture turn. `wait`: run between tries while another thread holds it (instead of
    blocking: a thread that others wait on keeps serving them)."""
    _take(wait)
    turn = Turn(wait)
    try:
        yield turn
    finally:
        if turn.held:
            _TURN.release()


@contextmanager
def capture_turn_if_free() -> Iterator[bool]:
    """Hold the turn for the block if it is free now (yields True), else yield False at once: a request-path capture
    that runs uncaptured this time rather than wait for another thread's."""
    taken = _TURN.acquire(blocking=False)
    try:
        yield taken
    finally:
        if taken:
            _TURN.release()


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """`torch.cuda.graph` in thread-local mode, holding the turn."""
    with capture_turn(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield


def empty_cache() -> None:
    """`torch.cuda.empty_cache`, never while another thread captures."""
    with capture_turn():
        torch.cuda.empty_cache()


def prime_compiler_for_threads() -> None:
    """Run, once and before any server thread starts, the one FX symbolic trace Inductor makes on its first code
    generation (`InterpreterShim`'s cached dummy module, torch 2.11-2.13). A symbolic trace patches
    `torch.nn.Module.__call__` for the whole process while it runs, so any module another thread calls meanwhile
    fails with `NameError: module is not installed as a submodule` (H100, 2026-12-06: a server's i2v warm-up job
    encoding its image while the background ladder compiled). Best effort: a torch without that cache skips it."""
    try:
        from torch._inductor.loop_body import InterpreterShim
    except ImportError:
        return
    dummy = getattr(InterpreterShim, "_dummy_gm", None)
    if callable(dummy):
        dummy()
