"""`wamrt bench soak`: a server under hours of mixed traffic in minutes, measured from outside.

Starts `wamrt serve` (default `--model tiny-world --device cpu --steps 1`) in a process of its own and drives it
with `--clients` closed-loop clients. `--requests` requests are drawn from `soak_traffic.MIX`: good policy
requests on every surface (openpi and vLLM-Omni websockets, /v1/policy/infer as msgpack and JSON, /v1/videos
policy jobs, sync and polled), world generation (video, image), jobs deleted while they run, clients that hang up
mid-request, malformed requests (5 %: every kind of issue 39's list that is cheap to send) and plain reads. The
baseline draws from the same mix with the bad kinds (`soak_traffic.BAD`) replaced by reads, so both carry the
same good traffic; the two alternate in `ROUNDS` blocks, so that the load of a shared machine drifts over both
alike. Meanwhile the server's resident memory is sampled.

It reports every status seen, the 5xx among them (the bar: none), the RSS growth over the last half of the mixed
phase (the bar: flat, <= 5 %), and p50/p99 of the good policy requests with the bad traffic against without it
(the bar: p99 <= 1.5 x), as a `kind: soak` result file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ..provenance import environment
from .server_process import ServerProcess
from .soak_traffic import BAD, MIX, POLICY_KINDS, Outcome, Session, read
from .stats import summarize

ROUNDS = 10
DEFAULT_SERVE = ["--model", "tiny-world", "--device", "cpu", "--steps", "1", "--max-batch", "4"]  # cli/bench.py's


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[tuple[float, Outcome]] = []  # (monotonic end, outcome)

    def add(self, out: Outcome) -> None:
        with self.lock:
            self.outcomes.append((time.monotonic(), out))


def _run_phase(url: str, clients: int, total: int, pick: Any, seed: int, rec: _Recorder, progress: str) -> float:
    """`total` requests shared by `clients` threads, each drawing its next request with `pick(rng, i)`."""
    counter = iter(range(total))
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        session = Session(url, rng)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                rec.add(pick(rng, i)(session))
                if (i + 1) % 500 == 0:
                    print(f"  {progress}: {i + 1}/{total} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        finally:
            session.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def _policy_latencies(outcomes: list[Outcome]) -> list[float]:
    return [o.latency_ms for o in outcomes if o.kind in POLICY_KINDS and o.status == 200]


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.clients <= 8 or args.requests < 1:
        print("wamrt bench soak: --clients must be 1-8 and --requests >= 1", file=sys.stderr)
        return 2
    baseline_n = args.baseline if args.baseline is not None else max(100, args.requests // 10)
    names, weights = list(MIX), [MIX[k][0] for k in MIX]

    def mixed_pick(rng: random.Random, i: int) -> Any:
        return MIX[rng.choices(names, weights)[0]][1]

    def baseline_pick(rng: random.Random, i: int) -> Any:
        kind = rng.choices(names, weights)[0]
        return read if kind in BAD else MIX[kind][1]

    env = environment()  # at the start: the code under test (a commit made during the run is not it)
    samples: list[tuple[float, int]] = []  # (monotonic, rss bytes)
    heap: list[tuple[float, int | None]] = []  # (monotonic, the server's wamrt_heap_in_use_bytes)
    base, mixed, warm = _Recorder(), _Recorder(), _Recorder()
    seconds = {"baseline": 0.0, "mixed": 0.0}
    with ServerProcess.serve(args.serve.split()) as server:
        stop = threading.Event()

        def sample() -> None:
            k = 0
            while not stop.is_set():
                samples.append((time.monotonic(), server.rss()))
                if k % 10 == 0:  # the C heap's own books every 5 s: a leak against kept pages
                    heap.append((time.monotonic(), _heap_in_use(server.url)))
                k += 1
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # Every kind once, unmeasured (the first JSON decode, the first generation job...).
        _run_phase(server.url, 1, len(MIX), lambda rng, i: MIX[names[i]][1], args.seed, warm, "warm-up")
        mixed_start = time.monotonic()
        rounds = min(ROUNDS, args.requests)
        for r in range(rounds):
            share = (args.requests * (r + 1)) // rounds - (args.requests * r) // rounds
            base_share = (baseline_n * (r + 1)) // rounds - (baseline_n * r) // rounds
            print(f"round {r + 1}/{rounds}: {base_share} baseline, {share} mixed", file=sys.stderr)
            seconds["baseline"] += _run_phase(server.url, args.clients, base_share, baseline_pick,
                                              args.seed + 2 * r, base, "baseline")
            seconds["mixed"] += _run_phase(server.url, args.clients, share, mixed_pick, args.seed + 2 * r + 1,
                                           mixed, "mixed")
        stop.set()
        sampler.join(5)
        log_tail = server.log()[-4000:]
        mixed_end = time.monotonic()
    result = summarize_soak(args, base.outcomes, mixed.outcomes, samples, (mixed_start, mixed_end), seconds,
                            warm.outcomes, env, heap)
    result["server_log_tail"] = log_tail
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    brief = {k: result[k] for k in ("requests", "status_5xx", "rss_growth_pct", "p99_ratio", "passed")}
    print(json.dumps(brief))
    return 0 if result["passed"] else 1


def summarize_soak(args: argparse.Namespace, base: list[tuple[float, Outcome]], mixed: list[tuple[float, Outcome]],
                   samples: list[tuple[float, int]], span: tuple[float, float], seconds: dict[str, float],
                   warm: list[tuple[float, Outcome]], env: dict[str, Any],
                   heap: list[tuple[float, int | None]] = ()) -> dict[str, Any]:
    outs = [o for _, o in mixed]
    statuses = Counter(str(o.status) for o in outs)
    by_kind: dict[str, Counter] = {}
    for o in outs:
        by_kind.setdefault(o.kind, Counter())[str(o.status) if o.code is None else f"{o.status} {o.code}"] += 1
    fives = sum(o.status >= 500 for o in outs) + sum(o.status >= 500 for _, o in base) \
        + sum(o.status >= 500 for _, o in warm)
    # RSS over the last half of the run: the median of the samples around its midpoint against the median of
    # the last ones (medians: one sample can land inside a request's transient allocation).
    start, stop = span
    half = (start + stop) / 2
    mid = [r for t, r in samples if abs(t - half) <= max(15.0, (stop - start) / 40)]
    end = [r for t, r in samples if t >= stop - max(30.0, (stop - start) / 20)]
    rss_mid, rss_end = float(np.median(mid)), float(np.median(end))
    without, with_bad = _policy_latencies([o for _, o in base]), _policy_latencies(outs)
    s_without, s_with = summarize(without), summarize(with_bad)
    p99_ratio = s_with["p99_ms"] / s_without["p99_ms"]
    growth = 100.0 * (rss_end - rss_mid) / rss_mid
    step = max(1, len(samples) // 200)
    heap_mid = [b for t, b in heap if b is not None and abs(t - half) <= max(15.0, (stop - start) / 40)]
    heap_end = [b for t, b in heap if b is not None and t >= stop - max(30.0, (stop - start) / 20)]
    heap_growth = (100.0 * (np.median(heap_end) - np.median(heap_mid)) / np.median(heap_mid)
                   if heap_mid and heap_end else None)
    return {
        "kind": "soak",
        "command": f"wamrt bench soak --requests {args.requests} --clients {args.clients} --seed {args.seed} "
                   f"--serve '{args.serve}'",
        "serve": args.serve, "clients": args.clients, "seed": args.seed, **env,
        "requests": len(outs), "baseline_requests": len(base), "http_calls": sum(o.calls for o in outs),
        "seconds": seconds, "rounds": min(ROUNDS, args.requests),
        "status_counts": dict(statuses), "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "status_5xx": fives, "rss_growth_pct": growth,
        "rss_mb": {"start": samples[0][1] / 2**20, "after_warm_up": _at(samples, start) / 2**20,
                   "mid": rss_mid / 2**20, "end": rss_end / 2**20, "max": max(r for _, r in samples) / 2**20,
                   "series": [[round(t - samples[0][0], 1), round(r / 2**20, 1)] for t, r in samples[::step]]},
        # The C heap in use (glibc's books, /metrics): flat here under a growing RSS is pages the allocator keeps
        "heap_in_use_growth_pct": heap_growth,
        "heap_in_use_mb": [[round(t - samples[0][0], 1), round(b / 2**20, 1)] for t, b in heap if b is not None],
        "policy_without_bad_traffic": s_without, "policy_with_bad_traffic": s_with, "p99_ratio": p99_ratio,
        "bars": {"status_5xx": 0, "rss_growth_pct_max": 5.0, "p99_ratio_max": 1.5},
        "passed": fives == 0 and growth <= 5.0 and p99_ratio <= 1.5,
    }


def _heap_in_use(url: str) -> int | None:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("wamrt_heap_in_use_bytes "):
            return int(float(line.split()[1]))
    return None


def _at(samples: list[tuple[float, int]], when: float) -> float:
    return float(min(samples, key=lambda s: abs(s[0] - when))[1])
