import math

import pytest

from wamrt.eval.stats import (
    PairedTable,
    gate,
    mcnemar_exact,
    newcombe_paired_ci,
    paired_bootstrap_ci,
    wilson_ci,
)

Z = 1.959963984540054


def test_wilson_interval_holds_the_rate_exactly():
    for n in range(1, 301):
        for k in (0, 1, n // 3, n - 1, n):
            lo, hi = wilson_ci(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n)
    assert wilson_ci(0, 24)[0] == 0.0 and wilson_ci(24, 24)[1] == 1.0


def test_wilson_hand_values():
    # 0/10: lower 0, upper z^2/n / (1 + z^2/n)
    lo, hi = wilson_ci(0, 10)
    assert lo == 0.0 and hi == pytest.approx((Z * Z / 10) / (1 + Z * Z / 10), abs=1e-12)
    assert hi == pytest.approx(0.27753, abs=1e-5)
    # 90/100 by the formula written out: centre 0.88546..., half-width 0.05956...
    lo, hi = wilson_ci(90, 100)
    assert (lo, hi) == pytest.approx((0.825634, 0.944771), abs=1e-6)
    # 8/10 (textbook value 0.4902 .. 0.9433)
    assert wilson_ci(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_ci(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_ci(11, 10)


def test_mcnemar_exact_hand_values():
    assert mcnemar_exact(0, 6) == 2 / 64  # 2 * P(X <= 0), X ~ Bin(6, 1/2)
    assert mcnemar_exact(1, 9) == 2 * (1 + 10) / 1024
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 40) == pytest.approx(2 * 0.5**40)


def test_newcombe_paired_hand_computation():
    t = PairedTable(both=12, baseline_only=9, candidate_only=2, neither=11)  # n = 34
    n = 34
    p1, p2 = 21 / n, 14 / n
    l1, u1 = wilson_ci(21, n)
    l2, u2 = wilson_ci(14, n)
    phi = (12 * 11 - 9 * 2) / math.sqrt(21 * 13 * 14 * 20)
    lower = (p2 - p1) - math.sqrt((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2)
    upper = (p2 - p1) + math.sqrt((u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2)
    assert newcombe_paired_ci(t) == pytest.approx((lower, upper), abs=1e-12)
    assert newcombe_paired_ci(t) == pytest.approx((-0.363921, -0.025233), abs=1e-6)
    # Identical outcomes: symmetric and narrow around 0.
    lo, hi = newcombe_paired_ci(PairedTable(180, 0, 0, 20))
    assert lo == pytest.approx(-hi) and 0 < hi < 0.02


def test_bootstrap_and_gate():
    same = [True] * 180 + [False] * 20
    assert paired_bootstrap_ci(same, same) == (0.0, 0.0)
    lo, hi = paired_bootstrap_ci(same, [True] * 140 + [False] * 60, seed=1)
    assert -0.26 < lo < hi < -0.14
    assert gate(same, same).verdict == "pass"
    broken = gate(same, [True] * 140 + [False] * 60)
    assert broken.verdict == "fail" and broken.p_value < 0.01 and broken.diff == pytest.approx(-0.2)
    assert gate([True, False] * 5, [False, True] * 5).verdict == "inconclusive"  # 10 episodes prove nothing
    with pytest.raises(ValueError):
        gate([True], [True, False])
