"""The process's capture turn (ops.capture_turn): one thread warms up and captures at a time, a thread that others
wait on keeps serving them while it waits for the turn, and a turn let go between captures lets another thread in.
The CUDA side (a world job capturing beside the background ladder) is in tests/engine/test_graph_memory_gpu.py."""

from __future__ import annotations

import threading

import pytest

from wamrt.ops.capture_turn import capture_turn, release_capture_turn, try_capture_turn


def _holder(hold: threading.Event, release: threading.Event) -> threading.Thread:
    def run() -> None:
        with capture_turn():
            hold.set()
            release.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert hold.wait(10)
    return thread


def test_a_waiting_thread_runs_its_wait_callback_until_the_holder_lets_go():
    hold, release = threading.Event(), threading.Event()
    holder = _holder(hold, release)
    calls = 0

    def wait() -> None:  # a world job handing the device to a policy batch
        nonlocal calls
        calls += 1
        if calls == 5:
            release.set()

    with capture_turn(wait=wait):
        assert calls >= 5
    holder.join(10)
    assert not holder.is_alive()


def test_try_fails_while_another_thread_holds_the_turn_and_succeeds_after():
    hold, release = threading.Event(), threading.Event()
    holder = _holder(hold, release)
    assert not try_capture_turn()  # a request-path VAE capture runs uncaptured instead of waiting
    release.set()
    holder.join(10)
    assert try_capture_turn()
    release_capture_turn()


def test_a_turn_let_go_between_captures_lets_another_thread_capture_and_is_taken_back():
    order: list[str] = []
    other_done = threading.Event()

    def other() -> None:
        with capture_turn():
            order.append("other")
        other_done.set()

    with capture_turn() as turn:
        order.append("warm-up")
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        assert not other_done.wait(0.2)  # blocked while this thread holds the turn
        with turn.let_go():
            assert other_done.wait(10)
        order.append("segment")
        assert turn.held
    assert order == ["warm-up", "other", "segment"]
    assert try_capture_turn()  # released at the end
    release_capture_turn()


def test_a_cancelled_wait_while_taking_the_turn_back_leaves_it_released():
    """`wait` raises (the job was cancelled) while the turn is taken back after a pause: the error propagates, not
    a release of a lock this thread does not hold."""
    hold, release = threading.Event(), threading.Event()

    class Cancelled(Exception):
        pass

    def wait() -> None:
        raise Cancelled

    with pytest.raises(Cancelled), capture_turn(wait=wait) as turn, turn.let_go():
        _holder(hold, release)  # another thread takes the turn during the pause
    assert not turn.held
    release.set()
