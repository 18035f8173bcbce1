"""scripts/gpu_clocks.py: the summary of the clock log gpu_run.sh samples beside every GPU part."""

from __future__ import annotations

import importlib.util
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
