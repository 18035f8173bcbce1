"""Where a profiled request's GPU time went besides kernels. `--trace` rows record `gpu_timeline(kernel_intervals(
prof))`; `wamrt bench timeline TRACE.json` reads a saved Chrome trace the same way and prints it.

The request's GPU activity splits at idle gaps of `split_us` or more into segments: the frame-0 VAE graph, the
host work around it (transfers, the pre-replay copies), the denoise graph. Inside a CUDA graph the gaps are launch
latency between kernels; a long gap between segments is host work the GPU waited on (the profiler inflates that
part: judge it by the stage times of the timed requests)."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

Interval = tuple[float, float, str]  # start us, end us, name


def kernel_intervals(prof) -> list[Interval]:
    """Every GPU activity (kernels, memsets, copies) of a torch.profiler run."""
    return [(float(e.time_range.start), float(e.time_range.end), e.name) for e in prof.events()
            if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]


def chrome_trace_intervals(path: Path) -> list[Interval]:
    """The same from a trace written by `prof.export_chrome_trace` (`.json`, or `.json.gz` as the rows write it)."""
    raw = Path(path).read_bytes()
    events = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["traceEvents"]
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur", 0) > 0]


def gpu_timeline(intervals: list[Interval], n_gaps: int = 8, split_us: float = 100.0, n_segments: int = 8) -> dict:
    """span (first activity's start to the last one's end), busy (the union of the activities), idle = span - busy,
    the `n_gaps` longest gaps with the activities either side, and the `n_segments` busiest segments (split at gaps
    >= split_us), in time order."""
    if not intervals:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gap_count": 0, "gaps": [], "segments": []}
    ordered = sorted(intervals)
    t0 = ordered[0][0]
    gaps: list[tuple[float, str, str]] = []
    segments: list[dict] = []
    cur_start, cur_end, cur_name = ordered[0]  # the block of overlapping activities being merged
    seg = {"start": cur_start, "first": cur_name, "activities": 0, "busy": 0.0}

    def close_segment() -> None:
        span = cur_end - seg["start"]
        segments.append({"start_ms": (seg["start"] - t0) / 1e3, "span_ms": span / 1e3, "busy_ms": seg["busy"] / 1e3,
                         "idle_ms": (span - seg["busy"]) / 1e3, "activities": seg["activities"],
                         "first": seg["first"][:80]})

    for start, end, name in ordered:
        if start > cur_end:
            seg["busy"] += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            if start - cur_end >= split_us:
                close_segment()
                seg = {"start": start, "first": name, "activities": 0, "busy": 0.0}
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
        seg["activities"] += 1
    seg["busy"] += cur_end - cur_start
    close_segment()
    span = cur_end - t0
    busy = sum(s["busy_ms"] for s in segments) * 1e3
    gaps.sort(key=lambda g: -g[0])
    kept = sorted(sorted(segments, key=lambda s: -s["busy_ms"])[:n_segments], key=lambda s: s["start_ms"])
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "gap_count": len(gaps),
            "gaps": [{"ms": g / 1e3, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:n_gaps]],
            "segments": kept}


def format_timeline(line: dict) -> str:
    out = [f"GPU span {line['span_ms']:.2f} ms, busy {line['busy_ms']:.2f}, idle {line['idle_ms']:.2f} in "
           f"{line['gap_count']} gaps", "segments (split at long gaps; the busiest, in time order):"]
    out += [f"  at {s['start_ms']:9.2f} ms: span {s['span_ms']:9.2f}, busy {s['busy_ms']:9.2f}, idle "
            f"{s['idle_ms']:7.2f} over {s['activities']:5d} activities, from {s['first']}" for s in line["segments"]]
    out.append("longest gaps:")
    out += [f"  {g['ms']:9.3f} ms after {g['after']} before {g['before']}" for g in line["gaps"]]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    for path in args.traces:
        print(f"{path}\n{format_timeline(gpu_timeline(chrome_trace_intervals(Path(path)), split_us=args.split_us))}")
    return 0
