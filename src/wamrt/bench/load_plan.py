"""Issue 40's bars from one `scripts/gpu_run.sh load-plan*` results folder: `python -m wamrt.bench.load_plan DIR`.

Reads the `kind: load` rows (LABEL-N.json, LABEL-N-gen.json), the engine row they are compared with
(latency/*-E5-serve.json) and the device memory sampled beside the server (LABEL-gpu-memory.csv, nvidia-smi: the
CUDA context included); writes DIR/bars.json and prints one line per bar. The 1-lane row gains `engine_row` (that
row's p50 and the ratio)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any


def device_peak_gib(csv: Path) -> float | None:
    """The largest memory.used (MiB) nvidia-smi sampled, in GiB; None without samples."""
    if not csv.is_file():
        return None
    used = []
    for line in csv.read_text().splitlines():
        try:
            used.append(float(line.rsplit(",", 1)[-1]))
        except ValueError:
            continue
    return round(max(used) / 1024, 2) if used else None


def _most(rows: dict[str, dict[str, Any]], field: str) -> Any:
    """The largest value of `field` over the rows; None when no row has one (a server without that metric)."""
    values = [r[field] for r in rows.values() if r.get(field) is not None]
    return max(values) if values else None


def _total(rows: dict[str, dict[str, Any]], field: str) -> Any:
    values = [r[field] for r in rows.values() if r.get(field) is not None]
    return sum(values) if values else None


def bars(folder: Path) -> dict[str, Any]:
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for f in sorted(folder.glob("*.json")):
        m = re.fullmatch(r"(.+)-(\d+(?:-gen)?)\.json", f.name)
        if m is None:
            continue
        data = json.loads(f.read_text())
        if data.get("kind") == "load":
            rows.setdefault(m.group(1), {})[m.group(2)] = data
    engine = next(iter(sorted(folder.glob("latency/*-E5-serve.json"))), None)
    engine_p50 = json.loads(engine.read_text())["p50_ms"] if engine else None
    out: dict[str, Any] = {}
    for label, by_lanes in rows.items():
        one = by_lanes.get("1", {})
        got: dict[str, Any] = {
            "gpu_memory_cap_gib": one.get("gpu_memory_cap_gib"), "warmup_s": one.get("warmup_s"),
            "graph_ladder_s": one.get("graph_ladder_s"),
            "graph_captures_after_warmup": _most(by_lanes, "graph_captures_after_warmup"),
            "requests_waited_on_capture": _total(by_lanes, "requests_waited_on_capture"),
            "errors": {n: r.get("errors") for n, r in by_lanes.items() if r.get("errors")},
            "peak_gpu_gib": _most(by_lanes, "peak_gpu_gib"),
            "device_peak_gib": device_peak_gib(folder / f"{label}-gpu-memory.csv"),
            "p50_ms": {n: r.get("p50_ms") for n, r in by_lanes.items()},
            "p99_ms": {n: r.get("p99_ms") for n, r in by_lanes.items()},
        }
        if one.get("p50_ms"):
            got["p99_over_p50_1_lane"] = round(one["p99_ms"] / one["p50_ms"], 4)
        for n, r in by_lanes.items():
            if "efficiency_vs_baseline" in r:
                got[f"efficiency_{n}_lanes"] = round(r["efficiency_vs_baseline"], 3)
            if "p99_over_baseline_p99" in r and n.endswith("-gen"):
                got[f"p99_over_solo_p99_{n}"] = round(r["p99_over_baseline_p99"], 3)
                got["generation_jobs"] = (r.get("background_generation") or {}).get("jobs_completed")
        if engine_p50 and one.get("p50_ms") and label == "nano80":
            got["engine_row_p50_ms"] = engine_p50
            got["p50_over_engine_row"] = round(one["p50_ms"] / engine_p50, 4)
            one["engine_row"] = {"file": str(engine.relative_to(folder)), "p50_ms": engine_p50,  # type: ignore[union-attr]
                                 "p50_over_engine_row": got["p50_over_engine_row"]}
            (folder / f"{label}-1.json").write_text(json.dumps(one, indent=2))
        out[label] = got
    return out


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv or sys.argv[1:])[0])
    result = bars(folder)
    (folder / "bars.json").write_text(json.dumps(result, indent=2))
    for label, got in result.items():
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
