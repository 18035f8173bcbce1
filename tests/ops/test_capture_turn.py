"""The process's capture turn (ops.capture_turn): one thread warms up and captures at a time, a thread that others
wait on keeps serving them while it waits for the turn, and a turn let go between captures lets another thread in.
The CUDA side (a world job capturing beside the background ladder) is in tests/engine/test_graph_memory_gpu.py."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
from oracle.turn_holder import turn_held_elsewhere

from wamrt.ops.capture_turn import capture_turn, capture_turn_if_free


def test_a_waiting_thread_runs_its_wait_callback_until_the_holder_lets_go():
    calls = 0
    with turn_held_elsewhere() as release:

        def wait() -> None:  # a world job handing the device to a policy batch
            nonlocal calls
            calls += 1
            if calls == 5:
                release.set()

        with capture_turn(wait=wait):
            assert calls >= 5


def test_try_fails_while_another_thread_holds_the_turn_and_succeeds_after():
    with turn_held_elsewhere(), capture_turn_if_free() as free:
        assert not free  # a request-path VAE capture runs uncaptured instead of waiting
    with capture_turn_if_free() as free:
        assert free
    with turn_held_elsewhere():  # and let go at the block's end: another thread takes it
        pass


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
    with capture_turn_if_free() as free:
        assert free  # released at the end


def test_a_cancelled_wait_while_taking_the_turn_back_leaves_it_released():
    """`wait` raises (the job was cancelled) while the turn is taken back after a pause: the error propagates, not
    a release of a lock this thread does not hold."""

    class Cancelled(Exception):
        pass

    def wait() -> None:
        raise Cancelled

    with ExitStack() as later:
        with pytest.raises(Cancelled), capture_turn(wait=wait) as turn, turn.let_go():
            later.enter_context(turn_held_elsewhere())  # another thread takes the turn during the pause
        assert not turn.held
