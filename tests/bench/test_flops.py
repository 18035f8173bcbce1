"""The analytic request FLOPs behind every result file's floor and TFLOP/s: the floors of
../shared/docs/performance.md assume CFG on every step, so a guidance interval scales them."""

from __future__ import annotations

import pytest

from wamrt.bench.flops import COMPUTE_FLOOR_MS, guidance_share, request_flops
from wamrt.model.config import get_config

FLOOR_TABLE_REL = 0.03


@pytest.mark.parametrize("size", ["edge", "nano"])
def test_floor_table_matches_the_flop_count(size):
    """The table's 4-step bf16 floor is the counted request at 790 TFLOP/s, to the 2 % by which performance.md's
    per-step TFLOP (22.4 Edge, 99.8 Nano) exceed these linear + attention counts (111.6 / 496.2 ms)."""
    flops = request_flops(get_config(size), text=[125, 30], gen_tokens=3092, cfg_steps=[True] * 4)
    assert flops / 790e12 * 1e3 == pytest.approx(COMPUTE_FLOOR_MS[(size, 4)], rel=FLOOR_TABLE_REL)


@pytest.mark.parametrize("size", ["edge", "nano"])
def test_guidance_share_of_a_first_step_interval(size):
    cfg = get_config(size)
    assert guidance_share(cfg, [True] * 4) == 1.0
    first_only = guidance_share(cfg, [True, False, False, False])
    # 5 Generator passes instead of 8; the unconditional prompt (30 tokens) is shorter, so a bit over 5/8
    assert 5 / 8 < first_only < 5 / 8 + 0.01
    assert guidance_share(cfg, [True, True, False, False]) > first_only
    assert guidance_share(cfg, [False] * 4) == pytest.approx(0.5, abs=0.01)
