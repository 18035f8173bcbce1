"""Waiting on world-generation jobs in the serving tests: a /v1/videos job reaching a status, and the server's
generation worker going idle."""

from __future__ import annotations

import time
from typing import Any

import httpx

FINISHED = ("completed", "failed", "cancelled")


def poll_job(url: str, vid: str, until: tuple[str, ...] = FINISHED, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = httpx.get(f"{url}/v1/videos/{vid}").json()
        if rec["status"] in until:
            return rec
        time.sleep(0.01)
    raise AssertionError(f"job {vid} never reached {until}")


def wait_generation_idle(server: Any, timeout: float = 10.0) -> None:
    worker = server.service.generation
    deadline = time.monotonic() + timeout
    while (worker.running is not None or worker.depth) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.running is None and worker.depth == 0, "the generation worker did not stop"
