"""Give freed heap memory back to the system, so that a long-running server's RSS stays flat.

glibc's malloc returns freed memory to the system only from the top of each heap (and from each thread's arena
only when asked), and its mmap threshold rises after the first large free, so request bodies (~1 MB an
observation), decoded images and CPU tensors of many sizes, allocated and freed by several threads, leave
holes that RSS keeps counting. The soak (`wamrt bench soak`, docs/serving.md) measured a server growing ~9 KB
a request over 10 000 of them with no Python object left behind (tracemalloc within a few MB). `malloc_trim(0)`
releases the free pages inside every arena (glibc >= 2.8 madvises them), a few milliseconds of work, done here
on a timer thread: it gives back tens of MB at times, but did not flatten that trend (pinning the mmap
threshold did halve it, at 40-100 % more CPU policy latency: not done). On other C libraries nothing runs.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger("wamrt.serving")


def _malloc_trim() -> object | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_stats() -> dict[str, int] | None:
    """glibc's own books (mallinfo2, glibc >= 2.33): bytes the C heap has handed out and not taken back
    (`in_use`: chunks in use plus mmapped blocks) and bytes it holds free (`free`). RSS minus these is code,
    Python's own arenas and other mappings. None where mallinfo2 does not exist. A flat `in_use` under a
    growing RSS is the allocator keeping freed pages, not a leak."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


def trim_periodically(interval_s: float, stop: threading.Event) -> threading.Thread | None:
    """Start a daemon thread calling `malloc_trim(0)` every `interval_s` until `stop` is set; None where glibc's
    malloc_trim does not exist."""
    trim = _malloc_trim()
    if trim is None:
        log.info("malloc_trim unavailable: the server's RSS is left to the C library")
        return None

    def loop() -> None:
        while not stop.wait(interval_s):
            trim(0)  # type: ignore[operator]

    thread = threading.Thread(target=loop, name="wamrt-malloc-trim", daemon=True)
    thread.start()
    return thread
