"""`wamrt bench load`: closed-loop lanes over the openpi websocket against a running server.

Each lane is one connection that sends an observation, waits for the reply, and sends the next (like
one sim env). Lanes cycle through an instruction set (`--prompts`: one fixed instruction, a built-in mix
of twelve lengths, or a file), each from its own offset, so with several instructions a batch mixes
prefix lengths as a robot fleet's does. A row runs for `--seconds` or `--requests`. Reports throughput,
p50/p90/p99 latency, the server's batch-size histogram (from the replies' `timing.batch_size`), the
distinct instruction token counts the server ran (`metadata.prompt_tokens`), the CUDA graphs it captured
during the row (`wamrt_graph_captures_total` on its /metrics) and errors by type. Bounded on purpose:
loopback URLs only, at most `MAX_LANES` lanes and `MAX_SECONDS` seconds, so it can never be pointed at
someone else's server. Writes a `kind: load` result (../shared/docs/performance.md) with `--out FILE`.

`--background-generation FIELDS` runs world-generation jobs back to back on the same server while the lanes
measure (`background_generation.py`); the lanes' numbers are the same fields as without, so a row with and a
row without compare directly (`--baseline`), and the result gains a `background_generation` object.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import platform
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import Request, urlopen

import numpy as np

from ..provenance import environment
from .background_generation import BackgroundGeneration
from .catalog import MAX_LANES, MAX_SECONDS
from .prompts import load_prompts
from .stats import summarize


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
    prompt_lengths: set[int] = field(default_factory=set)  # the server's metadata.prompt_tokens
    errors: Counter = field(default_factory=Counter)


@dataclass
class LanePlan:
    """What one lane sends: `warmup` unmeasured, then `measured` (or until the deadline) cycling `cycle`."""

    warmup: list[dict[str, Any]]
    cycle: list[dict[str, Any]]
    measured: int | None  # None: until the deadline


def plan_lanes(observations: list[dict[str, Any]], lanes: int, warmup: int, requests: int | None) -> list[LanePlan]:
    """Lane i cycles the observations from offset i * P // lanes, so lanes sent at the same moment carry
    different instructions. Warm-up: lane i first primes observations i, i + lanes, ... (together the
    lanes send each one once: its Reasoner K/V is then cached), then tops up to `warmup` from its cycle."""
    n = len(observations)
    quota = None if requests is None else math.ceil(requests / lanes)
    plans = []
    for i in range(lanes):
        start = i * n // lanes
        cycle = observations[start:] + observations[:start]
        prime = observations[i::lanes] if warmup > 0 and n > 1 else []
        plans.append(LanePlan(prime + [cycle[k % n] for k in range(max(warmup - len(prime), 0))], cycle, quota))
    return plans


def _lane(url: str, api_key: str | None, plan: LanePlan, start: threading.Barrier, stop_at: list[float],
          stats: LaneStats, period_s: float = 0.0) -> None:
    from ..client import PolicyClient, ServerError

    try:
        client = PolicyClient(url, api_key=api_key)
    except Exception as exc:  # noqa: BLE001  # any connect failure is a counted lane error
        stats.errors[f"connect:{type(exc).__name__}"] += 1
        start.abort()
        return
    with client:
        for obs in plan.warmup:
            try:
                client.infer(obs)
            except ServerError as exc:
                stats.errors[exc.code] += 1
        try:
            start.wait()
        except threading.BrokenBarrierError:
            return
        sent = 0
        while time.monotonic() < stop_at[0] and (plan.measured is None or sent < plan.measured):
            obs = plan.cycle[sent % len(plan.cycle)]
            sent += 1
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
            if period_s > 0:  # a robot's clock: the next chunk is asked for one period after this one was
                time.sleep(max(0.0, t0 + period_s - time.monotonic()))
            if isinstance(reply, dict):
                stats.batch_sizes[int(reply.get("timing", {}).get("batch_size", 0))] += 1
                tokens = (reply.get("metadata") or {}).get("prompt_tokens")
                if tokens is not None:
                    stats.prompt_lengths.add(int(tokens))


def metrics_url(url: str) -> str:
    """The server's Prometheus page: same host and port as its websocket."""
    parsed = urlparse(url)
    return f"{'https' if parsed.scheme == 'wss' else 'http'}://{parsed.netloc}/metrics"


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """The samples of the server's /metrics page, labelled ones under `name{labels}` ({} when it cannot be read)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urlopen(Request(metrics_url(url), headers=headers), timeout=10) as resp:  # noqa: S310  # loopback only
            text = resp.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not name.startswith("#"):
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


# Generation's share of the device during a row (GenerationWorker counters): it shows generation's progress even
# when no job finishes inside the row (under saturating policy traffic it gets no device time, by design).
GENERATION_COUNTERS = {"device_s": "wamrt_generation_device_seconds_total",
                       "segments": "wamrt_generation_segments_total"}


# How the server ran the row's requests and what it held (the fast engine's /metrics); deltas over the row for the
# counters, the end of the row for the gauges.
SERVER_COUNTERS = {"requests_waited_on_capture": 'wamrt_graph_requests_total{path="waited"}',
                   "requests_on_wider_graph": 'wamrt_graph_requests_total{path="wider"}',
                   "requests_on_smaller_graphs": 'wamrt_graph_requests_total{path="split"}',
                   "requests_eager_while_capturing": 'wamrt_graph_requests_total{path="eager"}',
                   "requests_out_of_memory": "wamrt_out_of_memory_refused_total"}
SERVER_GAUGES = {"peak_gpu_gib": "wamrt_gpu_memory_peak_reserved_bytes", "graph_pool_gib": "wamrt_graph_pool_bytes",
                 "graph_arena_gib": "wamrt_graph_arena_bytes"}


def server_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in SERVER_COUNTERS.items():
        out[key] = int(after[name] - before.get(name, 0.0)) if name in after else None
    for key, name in SERVER_GAUGES.items():
        out[key] = round(after[name] / 2**30, 3) if name in after else None
    return out


def _get_json(url: str, path: str, api_key: str | None = None) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parsed = urlparse(url)
    try:
        with urlopen(Request(f"{'https' if parsed.scheme == 'wss' else 'http'}://{parsed.netloc}{path}",  # noqa: S310
                             headers=headers), timeout=10) as resp:
            return json.loads(resp.read())
    except OSError as exc:  # /readyz answers 503 while warming up: its body still says why
        body = getattr(exc, "read", None)
        try:
            return json.loads(body()) if body else None
        except (ValueError, OSError):
            return None


def wait_for_graphs(url: str, timeout: float, api_key: str | None = None, *,
                    unreachable_s: float = 30.0) -> tuple[float, dict[str, Any] | None]:
    """Wait until the server is ready and its background captures are done (at most `timeout` s). Returns the
    seconds waited and the server's warm-up state (/readyz `warmup`; None from a server without one). Gives up
    once /readyz has not answered at all for `unreachable_s` (a server binds its port before it loads, so that
    is a server that died, not one still warming up)."""
    t0 = last_answer = time.monotonic()
    while True:
        reply = _get_json(url, "/readyz", api_key)
        now = time.monotonic()
        if reply is not None:
            last_answer = now
        ready = reply or {}
        warmup = ready.get("warmup")
        graphs = (warmup or {}).get("graphs") or {}
        if (ready.get("ready") and graphs.get("complete", True) or now - t0 >= timeout
                or now - last_answer >= unreachable_s):
            return round(now - t0, 1), warmup
        time.sleep(min(1.0, unreachable_s / 4))


def generation_counters(url: str, api_key: str | None = None) -> dict[str, float] | None:
    samples = scrape(url, api_key)
    if not all(name in samples for name in GENERATION_COUNTERS.values()):
        return None
    return {key: samples[name] for key, name in GENERATION_COUNTERS.items()}


def run_load(url: str, *, lanes: int, seconds: float | None = None, requests: int | None = None, warmup: int = 1,
             steps: int | None = None, api_key: str | None = None, obs: dict[str, Any] | None = None,
             prompts: list[str] | None = None, background: dict[str, Any] | None = None,
             generation_warmup: int = 1, graph_wait: float = 600.0, period_ms: float = 0.0) -> dict[str, Any]:
    """Run the lanes and return the summary (the `kind: load` fields). `prompts`: the instructions the lanes
    cycle through (default: `obs`'s own); `requests`: measure this many (rounded up to whole rounds of the
    lanes) with `seconds` as the cap, else run for `seconds` (default 10). `background`: multipart fields of a
    world-generation job submitted back to back while the lanes measure (after `generation_warmup` jobs alone).
    `period_ms`: each lane asks at most once per period (a robot that executes a chunk before asking for the next:
    2,133 ms for 32 steps at 15 Hz); 0: back to back, the device never idle (generation then gets only the gaps)."""
    from ..sample import sample_observation

    check_url(url)
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"--lanes must be in [1, {MAX_LANES}]")
    if requests is not None and requests < 1:
        raise ValueError(f"--requests must be >= 1, got {requests}")
    if seconds is None:
        seconds = MAX_SECONDS if requests is not None else 10.0
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"--seconds must be in (0, {MAX_SECONDS:.0f}]")
    if not 0 <= period_ms <= 1e3 * MAX_SECONDS:
        raise ValueError(f"--lane-period-ms must be in [0, {1e3 * MAX_SECONDS:.0f}], got {period_ms}")
    if generation_warmup < 0:
        raise ValueError(f"--generation-warmup must be >= 0, got {generation_warmup}")
    base = dict(obs or sample_observation(0))
    if steps is not None:
        base["params"] = {"num_steps": steps}
    observations = [{**base, "prompt": p} for p in prompts] if prompts else [base]
    plans = plan_lanes(observations, lanes, warmup, requests)
    stats = [LaneStats() for _ in range(lanes)]
    stop_at = [float("inf")]
    start = threading.Barrier(lanes + 1)
    threads = [threading.Thread(target=_lane, args=(url, api_key, plan, start, stop_at, s, period_ms / 1e3),
                                daemon=True) for plan, s in zip(plans, stats, strict=True)]
    waited, warm_state = wait_for_graphs(url, graph_wait, api_key) if graph_wait > 0 else (0.0, None)
    meta = _get_json(url, "/v1/policy/metadata", api_key) or {}
    plan = meta.get("memory_plan") or {}
    generation = None
    if background is not None:  # its warm-up runs alone, before the lanes' and before captures are counted
        generation = BackgroundGeneration(url, background, api_key)
        generation.warm_up(generation_warmup)
    before = scrape(url, api_key)  # before the lanes' warm-up: it counts too
    captures_before = before.get("wamrt_graph_captures_total")
    for t in threads:
        t.start()
    try:
        start.wait()  # every lane connected and warmed up
    except threading.BrokenBarrierError:
        pass
    gen_before = None
    if generation is not None:
        gen_before = generation_counters(url, api_key)
        generation.start()  # from the first measured request on
    t0 = time.monotonic()
    stop_at[0] = t0 + seconds
    for t in threads:
        t.join(seconds + 600)
    elapsed = time.monotonic() - t0
    background_summary = None
    if generation is not None:
        generation.stop()  # hangs up on a job still running: it does not run on into the next row
        gen_after = generation_counters(url, api_key)
        # Device time and segments generation ran during the row (null: the server exports no such counters).
        device_s = segments = share = None
        if gen_before is not None and gen_after is not None:
            device_s = round(gen_after["device_s"] - gen_before["device_s"], 3)
            segments = int(gen_after["segments"] - gen_before["segments"])
            share = round(device_s / elapsed, 4) if elapsed > 0 else None
        background_summary = {**generation.summary(), "device_s": device_s, "segments": segments,
                              "device_share": share}
    after = scrape(url, api_key)
    captures_after = after.get("wamrt_graph_captures_total")
    lat = np.array([x for s in stats for x in s.latencies_ms])
    hist: Counter = sum((s.batch_sizes for s in stats), Counter())
    errors: Counter = sum((s.errors for s in stats), Counter())
    lengths = sorted(set().union(*(s.prompt_lengths for s in stats)))
    captured = (None if captures_before is None or captures_after is None
                else int(captures_after - captures_before))

    reached = requests is not None and lat.size >= lanes * math.ceil(requests / lanes)

    def pct(q: float) -> float | None:
        return float(np.percentile(lat, q)) if lat.size else None

    return {"kind": "load", "lanes": lanes, "seconds": round(elapsed, 3), "requests": int(lat.size),
            "requests_target": requests, "lane_period_ms": period_ms,
            "stopped_by": "requests" if reached else "seconds",
            "throughput_rps": lat.size / elapsed if elapsed > 0 else 0.0, "p50_ms": pct(50), "p90_ms": pct(90),
            "p99_ms": pct(99), "max_ms": float(lat.max()) if lat.size else None,
            "p50_ci95_ms": summarize(lat.tolist())["ci95_p50_ms"] if lat.size else None,  # bootstrap of the median
            "batch_hist": {str(k): v for k, v in sorted(hist.items())}, "distinct_prompts": len(observations),
            "prompt_lengths": lengths or None, "graph_captures_after_warmup": captured, "errors": dict(errors),
            **server_deltas(before, after), "graph_wait_s": waited,
            "warmup_s": (warm_state or {}).get("seconds"),
            "graph_ladder_s": ((warm_state or {}).get("graphs") or {}).get("seconds"),
            "gpu_memory_cap_gib": plan.get("gpu_memory_cap_gib"), "memory_plan_gib": plan.get("total_gib"),
            **({} if background_summary is None else {"background_generation": background_summary})}


def check_baseline(baseline: dict[str, Any], model: Any, prompts: str, period_ms: float = 0.0) -> None:
    """A baseline must have run the same model on the same instructions at the same lane period (else requests/s
    do not compare)."""
    if baseline.get("model") != model:
        raise ValueError(f"baseline model {baseline.get('model')!r} != {model!r}")
    if float(baseline.get("lane_period_ms", 0.0)) != float(period_ms):
        raise ValueError(f"baseline lane_period_ms {baseline.get('lane_period_ms', 0.0)} != {period_ms}")
    # Files written before --prompts existed ran the fixed instruction.
    if baseline.get("prompts", "fixed") != prompts:
        raise ValueError(f"baseline prompts {baseline.get('prompts', 'fixed')!r} != {prompts!r}")


def scaling_vs(summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Throughput and tail relative to a baseline run (normally 1 lane) of the same request shape.

    Both runs send the same instructions, so FLOPs per request cancel: GPU efficiency (requests/s x
    FLOPs/request) relative to the baseline is the requests/s ratio. (With mixed instructions that holds on
    average, and exactly when the server pads every prefix to one width, `--prompt-width`.)"""
    check_baseline(baseline, summary.get("model"), summary.get("prompts", "fixed"), summary.get("lane_period_ms", 0.0))
    ratio = summary["throughput_rps"] / baseline["throughput_rps"]
    out = {"baseline": {"lanes": baseline["lanes"], "throughput_rps": baseline["throughput_rps"],
                        "p50_ms": baseline["p50_ms"], "p99_ms": baseline.get("p99_ms")},
           "rps_vs_baseline": ratio, "efficiency_vs_baseline": ratio,
           "max_over_baseline_p50": summary["max_ms"] / baseline["p50_ms"],
           "p99_over_baseline_p50": summary["p99_ms"] / baseline["p50_ms"]}
    if summary.get("p50_ms") and baseline.get("p99_ms"):
        # Same lanes with and without background generation: how much each end of the distribution moved.
        out.update(p50_over_baseline_p50=summary["p50_ms"] / baseline["p50_ms"],
                   p99_over_baseline_p99=summary["p99_ms"] / baseline["p99_ms"])
    return out


def run(args: argparse.Namespace) -> int:
    try:
        prompts = load_prompts(args.prompts)
        baseline = None
        if args.baseline:  # checked before the run, not after minutes of it
            baseline = json.loads(Path(args.baseline).read_text())
            check_baseline(baseline, args.model, args.prompts, args.lane_period_ms)
        summary = run_load(args.url, lanes=args.lanes, seconds=args.seconds, requests=args.requests,
                           warmup=args.warmup_requests, steps=args.steps, api_key=args.api_key, prompts=prompts,
                           background=args.background_generation, generation_warmup=args.generation_warmup,
                           graph_wait=args.graph_wait, period_ms=args.lane_period_ms)
    except (ValueError, OSError) as exc:
        print(f"wamrt bench load: {exc}", file=sys.stderr)
        return 2
    summary.update(model=args.model, prompts=args.prompts, command=" ".join(sys.argv), host=platform.node(),
                   **environment())
    print(f"{summary['lanes']} lanes, {summary['seconds']:.1f} s: {summary['requests']} requests, "
          f"{summary['throughput_rps']:.2f} req/s, p50 {summary['p50_ms']} ms, p90 {summary['p90_ms']} ms, "
          f"p99 {summary['p99_ms']} ms; batch sizes {summary['batch_hist']}; prompt lengths "
          f"{summary['prompt_lengths']}; graph captures after warm-up {summary['graph_captures_after_warmup']}, "
          f"requests that waited on a capture {summary['requests_waited_on_capture']}, on a wider graph "
          f"{summary['requests_on_wider_graph']}, on smaller graphs {summary['requests_on_smaller_graphs']}, "
          f"uncaptured {summary['requests_eager_while_capturing']}; peak GPU {summary['peak_gpu_gib']} GiB (cap "
          f"{summary['gpu_memory_cap_gib']}); server warm-up {summary['warmup_s']} s; errors {summary['errors']}")
    gen = summary.get("background_generation")
    if gen is not None:
        print(f"background generation: {gen['jobs_completed']} jobs done, {gen['jobs_failed']} failed, "
              f"{gen['jobs_cancelled_at_end']} cancelled at the end; job p50 {gen['job_p50_s']} s, server paused p50 "
              f"{gen['paused_ms_p50']} ms, model p50 {gen['model_ms_p50']} ms, longest segment "
              f"{gen['segment_max_ms']} ms ({gen.get('segment_max_span')}); device time {gen['device_s']} s in "
              f"{gen['segments']} segments "
              f"(share {gen['device_share']}); warm-up {gen['warmup_s']} s; first error {gen['first_error']}")
    if baseline is not None:
        summary.update(scaling_vs(summary, baseline))
        print(f"vs baseline ({summary['baseline']['lanes']} lanes): x{summary['rps_vs_baseline']:.2f} requests/s, "
              f"efficiency {summary['efficiency_vs_baseline']:.2f}, "
              f"slowest request {summary['max_over_baseline_p50']:.2f}x the baseline p50"
              + (f", p50 x{summary['p50_over_baseline_p50']:.3f}, p99 x{summary['p99_over_baseline_p99']:.3f}"
                 if "p99_over_baseline_p99" in summary else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
