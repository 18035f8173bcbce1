"""Summarise an `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 100` log (gpu_run.sh samples one per part): the SM
clock and power while the GPU was loaded, and the clock-event reasons seen. A sustained clock below the maximum
under load (power capping) makes every kernel proportionally slower than the same kernel timed in isolation."""

from __future__ import annotations

import statistics
import sys

# bits of nvmlClocksEventReasons (nvml.h)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


def summarise(lines: list[str], loaded_watts: float = 250.0) -> str:
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), float(parts[5]),
                         int(parts[6], 16)))
        except (IndexError, ValueError):
            continue
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


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summarise(f.readlines()))
