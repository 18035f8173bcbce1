"""`bench.timeline`: the idle time of a profiled request, from GPU activity intervals."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from wamrt.bench.timeline import chrome_trace_intervals, gpu_timeline, kernel_intervals
from wamrt.cli import main


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
    assert gpu_timeline([]) == {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gap_count": 0, "gaps": [],
                                "segments": []}


def test_kernel_intervals_keeps_device_activity_only():
    def event(kind, start, end, name):
        return SimpleNamespace(device_type=SimpleNamespace(name=kind), time_range=SimpleNamespace(start=start, end=end),
                               name=name)

    prof = SimpleNamespace(events=lambda: [event("CPU", 0, 50, "aten::mm"), event("CUDA", 10, 40, "nvjet"),
                                           event("CUDA", 45, 45, "zero-length marker")])
    assert kernel_intervals(prof) == [(10.0, 40.0, "nvjet")]


def test_segments_split_at_long_gaps():
    vae = [(10.0 * i, 10.0 * i + 8.0, f"conv{i}") for i in range(5)]  # 0..48 us, 2 us gaps
    graph = [(1000.0 + 5.0 * i, 1000.0 + 5.0 * i + 4.0, "gemm") for i in range(100)]  # 1 us gaps
    line = gpu_timeline(vae + [(300.0, 301.0, "copy")] + graph, split_us=100.0, n_segments=2)
    assert [s["first"] for s in line["segments"]] == ["conv0", "gemm"]  # the single copy is the least busy
    vae_seg, graph_seg = line["segments"]
    assert vae_seg["activities"] == 5 and vae_seg["span_ms"] == pytest.approx(0.048)
    assert vae_seg["busy_ms"] == pytest.approx(0.040) and vae_seg["idle_ms"] == pytest.approx(0.008)
    assert graph_seg["start_ms"] == pytest.approx(1.0) and graph_seg["activities"] == 100
    assert graph_seg["busy_ms"] == pytest.approx(0.4) and graph_seg["idle_ms"] == pytest.approx(0.099)


def test_chrome_trace_and_cli(tmp_path, capsys):
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 50},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 10, "dur": 5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90, "dur": 80},  # host side: not GPU time
              {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 95}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert chrome_trace_intervals(trace) == [(100.0, 150.0, "gemm"), (10.0, 15.0, "Memcpy HtoD")]
    packed = tmp_path / "trace.json.gz"  # as the --trace rows write it and the results folders keep it
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    assert chrome_trace_intervals(packed) == chrome_trace_intervals(trace)
    assert main(["bench", "timeline", str(trace), "--split-us", "50"]) == 0
    out = capsys.readouterr().out
    assert "GPU span 0.14 ms, busy 0.06, idle 0.09 in 1 gaps" in out
    assert "0.085 ms after Memcpy HtoD before gemm" in out
    assert out.count("  at ") == 2  # the 85 us gap splits the two
