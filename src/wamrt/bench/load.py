"""`wamrt bench load`: closed-loop lanes over the openpi websocket against a running server.

Each lane is one connection that sends an observation, waits for the reply, and sends the next (like
one sim env). Reports throughput, p50/p90/p99 latency, the server's batch-size histogram (from the
replies' `timing.batch_size`) and errors by type. Bounded on purpose: loopback URLs only, at most
`MAX_LANES` lanes and `MAX_SECONDS` seconds, so it can never be pointed at someone else's server.
Writes a `kind: load` result (../shared/docs/performance.md) with `--out FILE`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import platform
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from ..provenance import environment

MAX_LANES = 64
MAX_SECONDS = 600.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="ws://127.0.0.1:8000", help="loopback ws:// URL of a `wamrt serve`")
    ap.add_argument("--lanes", type=int, default=1, help=f"concurrent closed-loop lanes (1..{MAX_LANES})")
    ap.add_argument("--seconds", type=float, default=10.0, help=f"measured duration (max {MAX_SECONDS:.0f})")
    ap.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests per lane first")
    ap.add_argument("--steps", type=int, default=None, help="per-request params.num_steps")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="", help="label for the result file (e.g. nano)")
    ap.add_argument("--out", default=None, help="write the kind: load JSON result here")
    ap.add_argument("--baseline", default=None,
                    help="a 1-lane result file of the same model: adds requests/s, efficiency and tail ratios")


def check_url(url: str) -> str:
    """Loopback only: this tool generates load, so it refuses any other host."""
    parsed = urlparse(url)
    if parsed.scheme not in ("ws", "wss"):
        raise ValueError(f"--url must be ws:// or wss://, got {url!r}")
    host = parsed.hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--url must point at a loopback address (127.0.0.1, ::1, localhost), got {host!r}")
    return url


@dataclass
class LaneStats:
    latencies_ms: list[float] = field(default_factory=list)
    batch_sizes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)


def _lane(url: str, api_key: str | None, obs: dict[str, Any], warmup: int, start: threading.Barrier,
          stop_at: list[float], stats: LaneStats) -> None:
    from ..client import PolicyClient, ServerError

    try:
        client = PolicyClient(url, api_key=api_key)
    except Exception as exc:  # noqa: BLE001  # any connect failure is a counted lane error
        stats.errors[f"connect:{type(exc).__name__}"] += 1
        start.abort()
        return
    with client:
        for _ in range(warmup):
            try:
                client.infer(obs)
            except ServerError as exc:
                stats.errors[exc.code] += 1
        try:
            start.wait()
        except threading.BrokenBarrierError:
            return
        while time.monotonic() < stop_at[0]:
            t0 = time.monotonic()
            try:
                reply = client.infer(obs)
            except ServerError as exc:
                stats.errors[exc.code] += 1
                time.sleep(0.01)  # a busy server: back off a little instead of spinning
                continue
            except Exception as exc:  # noqa: BLE001  # connection lost: the lane ends
                stats.errors[type(exc).__name__] += 1
                return
            stats.latencies_ms.append(1e3 * (time.monotonic() - t0))
            if isinstance(reply, dict):
                stats.batch_sizes[int(reply.get("timing", {}).get("batch_size", 0))] += 1


def run_load(url: str, *, lanes: int, seconds: float, warmup: int = 1, steps: int | None = None,
             api_key: str | None = None, obs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the lanes and return the summary (the `kind: load` fields)."""
    from ..sample import sample_observation

    check_url(url)
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"--lanes must be in [1, {MAX_LANES}]")
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"--seconds must be in (0, {MAX_SECONDS:.0f}]")
    obs = dict(obs or sample_observation(0))
    if steps is not None:
        obs["params"] = {"num_steps": steps}
    stats = [LaneStats() for _ in range(lanes)]
    stop_at = [float("inf")]
    start = threading.Barrier(lanes + 1)
    threads = [threading.Thread(target=_lane, args=(url, api_key, obs, warmup, start, stop_at, s), daemon=True)
               for s in stats]
    for t in threads:
        t.start()
    try:
        start.wait()  # every lane connected and warmed up
    except threading.BrokenBarrierError:
        pass
    t0 = time.monotonic()
    stop_at[0] = t0 + seconds
    for t in threads:
        t.join(seconds + 600)
    elapsed = time.monotonic() - t0
    lat = np.array([x for s in stats for x in s.latencies_ms])
    hist: Counter = sum((s.batch_sizes for s in stats), Counter())
    errors: Counter = sum((s.errors for s in stats), Counter())

    def pct(q: float) -> float | None:
        return float(np.percentile(lat, q)) if lat.size else None

    return {"kind": "load", "lanes": lanes, "seconds": round(elapsed, 3), "requests": int(lat.size),
            "throughput_rps": lat.size / elapsed if elapsed > 0 else 0.0, "p50_ms": pct(50), "p90_ms": pct(90),
            "p99_ms": pct(99), "max_ms": float(lat.max()) if lat.size else None,
            "batch_hist": {str(k): v for k, v in sorted(hist.items())}, "errors": dict(errors)}


def scaling_vs(summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Throughput and tail relative to a baseline run (normally 1 lane) of the same request shape.

    Every request has the same shape, so FLOPs per request cancel: GPU efficiency (requests/s x
    FLOPs/request) relative to the baseline is the requests/s ratio."""
    if baseline.get("model") != summary.get("model"):
        raise ValueError(f"baseline model {baseline.get('model')!r} != {summary.get('model')!r}")
    ratio = summary["throughput_rps"] / baseline["throughput_rps"]
    return {"baseline": {"lanes": baseline["lanes"], "throughput_rps": baseline["throughput_rps"],
                         "p50_ms": baseline["p50_ms"]},
            "rps_vs_baseline": ratio, "efficiency_vs_baseline": ratio,
            "max_over_baseline_p50": summary["max_ms"] / baseline["p50_ms"],
            "p99_over_baseline_p50": summary["p99_ms"] / baseline["p50_ms"]}


def run(args: argparse.Namespace) -> int:
    try:
        summary = run_load(args.url, lanes=args.lanes, seconds=args.seconds, warmup=args.warmup_requests,
                           steps=args.steps, api_key=args.api_key)
    except ValueError as exc:
        print(f"wamrt bench load: {exc}", file=sys.stderr)
        return 2
    summary.update(model=args.model, command=" ".join(sys.argv), host=platform.node(), **environment())
    print(f"{summary['lanes']} lanes, {summary['seconds']:.1f} s: {summary['requests']} requests, "
          f"{summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']} ms, p90 {summary['p90_ms']} ms, "
          f"p99 {summary['p99_ms']} ms; batch sizes {summary['batch_hist']}; errors {summary['errors']}")
    if args.baseline:
        summary.update(scaling_vs(summary, json.loads(Path(args.baseline).read_text())))
        print(f"vs 1 lane: x{summary['rps_vs_baseline']:.2f} requests/s, "
              f"efficiency {summary['efficiency_vs_baseline']:.2f}, "
              f"slowest request {summary['max_over_baseline_p50']:.2f}x the 1-lane p50")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
