"""Another thread holding the process's CUDA-graph capture turn (ops.capture_turn), as the server's background
ladder does while it compiles and captures."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from wamrt.ops.capture_turn import capture_turn


@contextmanager
def turn_held_elsewhere() -> Iterator[threading.Event]:
    """Within the block another thread holds the turn; it lets go when the yielded event is set (or the block ends)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with capture_turn():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        yield release
    finally:
        release.set()
        thread.join(10)
