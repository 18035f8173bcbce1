"""Statistics for closed-loop success rates: Wilson intervals, paired tests and the gate verdict.

Pure Python + numpy, exact integer arithmetic where it matters (McNemar), so results are reproducible and
can be checked by hand in tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # standard normal 97.5% quantile


def wilson_ci(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (good coverage even at 0/n and n/n)."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # The interval holds p; at 0/n and n/n its bound equals p only up to rounding (0/24 gave 1.4e-17 > 0, and the
    # grid's chart refused the negative error bar).
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


@dataclass(frozen=True)
class PairedTable:
    """2x2 table of paired outcomes: both, baseline only, candidate only, neither."""

    both: int
    baseline_only: int
    candidate_only: int
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.baseline_only + self.candidate_only + self.neither

    @classmethod
    def from_outcomes(cls, baseline: Sequence[bool], candidate: Sequence[bool]) -> PairedTable:
        if len(baseline) != len(candidate):
            raise ValueError(f"paired outcomes differ in length: {len(baseline)} vs {len(candidate)}")
        pairs = list(zip(map(bool, baseline), map(bool, candidate), strict=True))
        return cls(pairs.count((True, True)), pairs.count((True, False)), pairs.count((False, True)),
                   pairs.count((False, False)))


def mcnemar_exact(baseline_only: int, candidate_only: int) -> float:
    """Two-sided exact McNemar test (= sign test on the discordant pairs, Binomial(b + c, 1/2))."""
    n = baseline_only + candidate_only
    if n == 0:
        return 1.0
    k = min(baseline_only, candidate_only)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # exact integers, no float underflow
    return min(1.0, 2 * tail / 2**n)


def newcombe_paired_ci(t: PairedTable, z: float = Z95) -> tuple[float, float]:
    """CI of p_candidate - p_baseline for paired binary data: Newcombe (1998) method 10 (Wilson-based,
    with the phi correlation of the 2x2 table)."""
    n = t.n
    if n == 0:
        return -1.0, 1.0
    p1 = (t.both + t.baseline_only) / n  # baseline
    p2 = (t.both + t.candidate_only) / n  # candidate
    l1, u1 = wilson_ci(t.both + t.baseline_only, n, z)
    l2, u2 = wilson_ci(t.both + t.candidate_only, n, z)
    a, b, c, d = t.both, t.baseline_only, t.candidate_only, t.neither
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    diff = p2 - p1
    lower = diff - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    upper = diff + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return max(-1.0, lower), min(1.0, upper)


def paired_bootstrap_ci(baseline: Sequence[bool], candidate: Sequence[bool], *, resamples: int = 10000,
                        seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(candidate) - mean(baseline), resampling pairs (seeded)."""
    diff = np.asarray(candidate, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diff.size == 0:
        return -1.0, 1.0
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks bound the [resamples, n] index matrix
        idx = rng.integers(0, diff.size, size=(min(1000, resamples - start), diff.size))
        means[start : start + idx.shape[0]] = diff[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


@dataclass(frozen=True)
class GateDecision:
    table: PairedTable
    p_value: float
    diff: float
    diff_ci95: tuple[float, float]
    verdict: str  # "pass" | "fail" | "inconclusive"


def gate(baseline: Sequence[bool], candidate: Sequence[bool], *, alpha: float = 0.05,
         margin: float = 0.05) -> GateDecision:
    """Non-inferiority gate on paired episodes (same seeds).

    fail: the candidate is worse and McNemar rejects equality at `alpha`, or the whole CI lies below -margin;
    pass: the CI's lower bound is >= -margin (any loss is at most `margin` with 95% confidence);
    inconclusive: otherwise (more episodes needed).
    """
    t = PairedTable.from_outcomes(baseline, candidate)
    p = mcnemar_exact(t.baseline_only, t.candidate_only)
    diff = (t.candidate_only - t.baseline_only) / t.n if t.n else 0.0
    lo, hi = newcombe_paired_ci(t)
    if (p < alpha and diff < 0) or hi < -margin:
        verdict = "fail"
    elif lo >= -margin:
        verdict = "pass"
    else:
        verdict = "inconclusive"
    return GateDecision(t, p, diff, (lo, hi), verdict)
