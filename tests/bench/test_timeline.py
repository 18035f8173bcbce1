"""`rows.gpu_timeline`: the idle time of a profiled request, from GPU activity intervals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from wamrt.bench.rows import gpu_timeline, kernel_intervals


def test_overlaps_merge_and_gaps_rank_longest_first():
    line = gpu_timeline([
        (0.0, 100.0, "gemm"),
        (50.0, 120.0, "overlapping copy"),  # overlaps gemm: busy to 120
        (60.0, 70.0, "nested memset"),  # inside: changes nothing
        (125.0, 200.0, "attention"),  # 5 us gap
        (1200.0, 1300.0, "vae conv"),  # 1000 us gap: host work
    ])
    assert line["span_ms"] == pytest.approx(1.3)
    assert line["busy_ms"] == pytest.approx((120 + 75 + 100) / 1e3)
    assert line["idle_ms"] == pytest.approx((5 + 1000) / 1e3)
    assert line["gap_count"] == 2
    assert [g["ms"] for g in line["gaps"]] == pytest.approx([1.0, 0.005])
    assert line["gaps"][0] == {"ms": pytest.approx(1.0), "after": "attention", "before": "vae conv"}
    assert line["gaps"][1]["after"] == "overlapping copy"  # the activity that ended last before the gap


def test_unsorted_input_and_gap_limit():
    intervals = [(10.0 * i, 10.0 * i + 5.0, f"k{i}") for i in range(20)][::-1]
    line = gpu_timeline(intervals, n_gaps=3)
    assert line["gap_count"] == 19 and len(line["gaps"]) == 3
    assert line["busy_ms"] == pytest.approx(20 * 5 / 1e3)
    assert line["idle_ms"] == pytest.approx(19 * 5 / 1e3)


def test_empty_profile():
    assert gpu_timeline([]) == {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gap_count": 0, "gaps": []}


def test_kernel_intervals_keeps_device_activity_only():
    def event(kind, start, end, name):
        return SimpleNamespace(device_type=SimpleNamespace(name=kind), time_range=SimpleNamespace(start=start, end=end),
                               name=name)

    prof = SimpleNamespace(events=lambda: [event("CPU", 0, 50, "aten::mm"), event("CUDA", 10, 40, "nvjet"),
                                           event("CUDA", 45, 45, "zero-length marker")])
    assert kernel_intervals(prof) == [(10.0, 40.0, "nvjet")]
