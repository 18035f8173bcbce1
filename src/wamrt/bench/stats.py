"""Summary statistics for latency samples (median, tail percentiles, bootstrap CI of the median)."""

from __future__ import annotations

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
