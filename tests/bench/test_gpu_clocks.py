"""scripts/gpu_clocks.py: the summary of the clock log gpu_run.sh samples beside every GPU part."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_clocks.py"
spec = importlib.util.spec_from_file_location("gpu_clocks", SCRIPT)
gpu_clocks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_clocks)


def test_loaded_samples_only_and_power_cap_reason():
    lines = ["2026/12/03 07:00:00.000, 1980, 1980, 690.1, 700.00, 61, 0x0000000000000000",
             "2026/12/03 07:00:00.100, 1755, 1980, 699.5, 700.00, 66, 0x0000000000000004",
             "2026/12/03 07:00:00.200, 1980, 1980, 80.0, 700.00, 40, 0x0000000000000001",  # idle: not counted
             "No devices were found"]
    line = gpu_clocks.summarise(lines)
    assert "2 of 3 samples" in line
    assert "SM median 1868 MHz (min 1755, max 1980; board max 1980)" in line
    assert "max temperature 66 C" in line and "power-capped in 1 samples" in line
    assert line.endswith("reasons seen: sw_power_cap")


def test_no_load():
    assert "none at >= 250 W" in gpu_clocks.summarise(["2026/12/03 07:00:00.200, 1980, 1980, 80.0, 700.00, 40, 0x1"])


def test_row_window_counts_only_its_samples(tmp_path, capsys):
    lines = ["2026/12/03 17:42:01.70, 1980, 1980, 400.0, 700.00, 50, 0x0000000000000000",  # before: the build
             "2026/12/03 17:42:01.82, 1620, 1980, 435.5, 700.00, 55, 0x0000000000000004",
             "2026/12/03 17:42:01.92, 1680, 1980, 458.3, 700.00, 55, 0x0000000000000004",
             "2026/12/03 17:42:02.02, 1980, 1980, 470.0, 700.00, 55, 0x0000000000000000",
             "2026/12/03 17:42:04.20, 1980, 1980, 300.0, 700.00, 50, 0x0000000000000000"]  # after
    record = {"kind": "latency", "model": "edge", "row": "E7", "steps": 2, "pace_hz": 15.0,
              "timed_utc": ["2026-12-03T17:42:01.800+00:00", "2026-12-03T17:42:02.100+00:00"]}
    line = gpu_clocks.summarise_row(lines, record)
    assert line == "edge E7 2 st @15 Hz: SM median 1680 MHz (min 1620, max 1980) over 3 samples, power-capped in 2"
    assert gpu_clocks.summarise_row(lines, {"kind": "latency"}) is None  # a file from before timed_utc
    log, row, other = tmp_path / "clocks.csv", tmp_path / "edge-s2-E7.json", tmp_path / "x.json"
    log.write_text("\n".join(lines))
    row.write_text(json.dumps(record))
    other.write_text(json.dumps({"kind": "quality"}))
    gpu_clocks.main([str(log), "--rows", str(row), str(other)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpu clocks under load") and out[1] == "  " + line and len(out) == 2


def test_gzipped_log_reads_as_the_plain_one(tmp_path, capsys):
    import gzip

    lines = ["2026/12/03 07:00:00.000, 1980, 1980, 690.1, 700.00, 61, 0x0000000000000000",
             "2026/12/03 07:00:00.100, 1755, 1980, 699.5, 700.00, 66, 0x0000000000000004"]
    plain, packed = tmp_path / "gpu-clocks.csv", tmp_path / "gpu-clocks.csv.gz"
    plain.write_text("\n".join(lines))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    gpu_clocks.main([str(plain)])
    first = capsys.readouterr().out
    gpu_clocks.main([str(packed)])
    assert capsys.readouterr().out == first and "2 of 2 samples" in first
