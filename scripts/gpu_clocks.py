"""Summarise an `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 100` log (gpu_run.sh samples one per part): the SM
clock and power while the GPU was loaded, and the clock-event reasons seen. A sustained clock below the maximum
under load (power capping) makes every kernel proportionally slower than the same kernel timed in isolation.

`--rows FILE...`: one more line per `wamrt bench latency` row file that records its `timed_utc` window, from the
samples inside it only (a part's summary mixes its rows: a 4-step bf16 row beside a 2-step fp8 one). nvidia-smi's
timestamps are the GPU machine's local time, UTC there. power.draw is an average that lags the load by a second or
more; the clock and the cap reason are what the sample saw."""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import statistics
from pathlib import Path

# bits of nvmlClocksEventReasons (nvml.h)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


def parse(lines: list[str]) -> list[tuple]:
    """(time, SM clock, max clock, power, power limit, temperature, reasons) per sample; other lines skipped."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.UTC)
            rows.append((when, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), float(parts[5]),
                         int(parts[6], 16)))
        except (IndexError, ValueError):
            continue
    return rows


def summarise(lines: list[str], loaded_watts: float = 250.0) -> str:
    rows = [r[1:] for r in parse(lines)]
    loaded = [r for r in rows if r[2] >= loaded_watts]
    if not loaded:
        return f"gpu clocks: {len(rows)} samples, none at >= {loaded_watts:.0f} W"
    clocks = [r[0] for r in loaded]
    seen = sorted({name for r in loaded for bit, name in REASONS.items() if r[5] & bit and name != "gpu_idle"})
    capped = sum(1 for r in loaded if r[5] & 0x4)
    return (f"gpu clocks under load ({len(loaded)} of {len(rows)} samples >= {loaded_watts:.0f} W): SM median "
            f"{statistics.median(clocks):.0f} MHz (min {min(clocks):.0f}, max {max(clocks):.0f}; board max "
            f"{loaded[0][1]:.0f}), power median {statistics.median(r[2] for r in loaded):.0f} W of "
            f"{loaded[0][3]:.0f} W limit, max temperature {max(r[4] for r in loaded):.0f} C, power-capped in "
            f"{capped} samples; reasons seen: {', '.join(seen) or 'none'}")


def summarise_row(lines: list[str], record: dict) -> str | None:
    """The SM clock while one latency row ran (its `timed_utc` window, warm-up included), or None without one."""
    window = record.get("timed_utc")
    if not window:
        return None
    start, end = (datetime.datetime.fromisoformat(t) for t in window)
    inside = [r for r in parse(lines) if start <= r[0] <= end]
    name = f"{record.get('model', '?')} {record.get('row', '?')} {record.get('steps', '?')} st"
    if record.get("pace_hz"):
        name += f" @{record['pace_hz']:g} Hz"
    if not inside:
        return f"{name}: no clock samples in its window"
    clocks = [r[1] for r in inside]
    capped = sum(1 for r in inside if r[6] & 0x4)
    return (f"{name}: SM median {statistics.median(clocks):.0f} MHz (min {min(clocks):.0f}, max {max(clocks):.0f}) "
            f"over {len(inside)} samples, power-capped in {capped}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the nvidia-smi csv")
    ap.add_argument("--rows", nargs="*", default=[], help="latency result files (others are skipped)")
    args = ap.parse_args(argv)
    log = Path(args.log)  # committed logs are gzipped (the raw samples compress ~10x)
    lines = (gzip.decompress(log.read_bytes()).decode() if log.suffix == ".gz" else log.read_text()).splitlines()
    print(summarise(lines))
    for path in args.rows:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("kind") == "latency" and (line := summarise_row(lines, record)):
            print(f"  {line}")


if __name__ == "__main__":
    main()
