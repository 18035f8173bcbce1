"""Summary statistics for latency samples (median, tail percentiles, bootstrap CI of the median)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def summarize(samples_ms: list[float], *, seed: int = 0, resamples: int = 2000) -> dict[str, float | list[float]]:
    a = np.asarray(samples_ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples")
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(a, size=(resamples, a.size), replace=True), axis=1)
    return {
        "p50_ms": float(np.median(a)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "min_ms": float(a.min()),
        "ci95_p50_ms": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "n": int(a.size),
    }


def median_stages(stage_samples: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in stage_samples for k in s})
    return {k: float(np.median([s[k] for s in stage_samples if k in s])) for k in keys}


def device_ms(fn: Callable[[], object], runs: int, device: Any) -> list[float]:
    """`runs` timed calls after an untimed one: CUDA events around each on CUDA (GPU time), else the wall clock."""
    import torch  # here, not at the top: the load bench's client side imports this module without torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times
