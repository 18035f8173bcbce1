"""Closed-loop policy latency against a running server (HTTP, msgpack): what the tests that keep policy requests'
latency while chat or world generation runs measure."""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx
import numpy as np

from wamrt.client.wire import unpackb

MSGPACK = {"content-type": "application/msgpack"}


def policy_request_ms(http: httpx.Client, blob: bytes) -> float:
    """One POST /v1/policy/infer of the msgpack observation `blob`: its wall time in ms (the answer must be a
    32 x 8 action chunk)."""
    t0 = time.perf_counter()
    r = http.post("/v1/policy/infer", content=blob, headers=MSGPACK)
    assert r.status_code == 200, r.text
    assert unpackb(r.content)["actions"].shape == (32, 8)
    return 1e3 * (time.perf_counter() - t0)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))
