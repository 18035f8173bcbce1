"""`wamrt bench waterfall`: a chart from committed result files, rows of several runs labelled with their commits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wamrt.bench.waterfall import bars, load_rows
from wamrt.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "latency"
NANO = [RESULTS / "2026-11-30-9d5c3fc" / "nano-s4-E0.json", RESULTS / "2026-12-03-42870eb-heads" /
        "nano-s4-E5-quack-heads-gqa.json", RESULTS / "2026-12-03-42870eb-heads" / "nano-s4-E6-heads-gqa.json"]


def test_chart_from_committed_files(tmp_path):
    out = tmp_path / "chart.png"
    assert main(["bench", "waterfall", *map(str, NANO), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    specs = bars(load_rows(NANO))
    rows = [json.loads(p.read_text()) for p in NANO]
    assert [s["ms"] for s in specs[:3]] == [r["p50_ms"] for r in rows]
    assert "9d5c3fc" in specs[0]["label"] and "42870eb" in specs[1]["label"]
    assert specs[2]["color"] != specs[1]["color"]  # the lossy row stands apart
    assert specs[-1]["label"].startswith("diffusers") and specs[-1]["ms"] == rows[0]["peer"]["p50_ms"]
    later_peer = bars(load_rows(NANO), peer_from=1)[-1]  # the peer of the run the chart is about
    assert "42870eb" in later_peer["label"] and later_peer["ms"] == rows[1]["peer"]["p50_ms"]


def test_refuses_mixed_models_and_other_files(tmp_path):
    with pytest.raises(SystemExit, match="several models"):
        load_rows([NANO[0], RESULTS / "2026-11-30-9d5c3fc" / "edge-s4-E0.json"])
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"kind": "quality"}))
    with pytest.raises(SystemExit, match="not a `kind: latency` result file"):
        load_rows([other])


def test_paced_rows_and_notes_are_labelled(tmp_path):
    pace = RESULTS / "2026-12-03-f584574-pace-ws0"
    files = [pace / "7-default-edge-s2-E7.json", pace / "8-ws0-15hz-edge-s2-E7.json"]
    specs = bars(load_rows(files, ["", "no cuBLASLt workspace"]))
    assert "Hz" not in specs[0]["label"] and "@15 Hz" in specs[1]["label"]
    assert specs[1]["label"].endswith("no cuBLASLt workspace") and "workspace" not in specs[0]["label"]
    out = tmp_path / "chart.png"
    assert main(["bench", "waterfall", str(files[0]), f"{files[1]}::no cuBLASLt workspace", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
