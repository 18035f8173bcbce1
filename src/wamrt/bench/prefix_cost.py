"""`wamrt bench prefix-cost`: what a prefix request costs on the eager reference, by mode, at a real size.

Issue 41 asks what inference-time RTC (`action_prefix_mode: "guided"`, a vector-Jacobian product through the
Generator at every denoising step: `pipeline.prefix.guided_velocity`) costs at Edge and Nano. The fast engine
refuses guided requests (its denoising loop is one CUDA graph without autograd), so both sides of the comparison
run on the eager reference `Policy`, random weights at the size's real shapes: a request without a prefix, with
`inpaint` (the prefix written into the state at each step's noise level: no extra work) and with `guided`, each
at the delays asked (the prefix is d rows of the plain reply). Rows: p50 with a bootstrap CI after warm-up, peak
device memory of the mode, the ratios guided / inpaint and inpaint / none. In one process, modes interleaved
request by request, so drift hits every mode alike.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..provenance import environment, utc_now
from .stats import median_stages, summarize

MODES = ("none", "inpaint", "guided")


def _request(obs: dict, prefix, mode: str) -> dict:
    if mode == "none":
        return obs
    return {**obs, "action_prefix": prefix, "action_prefix_mode": mode}


def _timed(policy, request: dict, seed: int, device: torch.device) -> tuple[float, int, dict[str, float]]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    chunk = policy.infer(request, seed=seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return 1e3 * (time.perf_counter() - t0), peak, chunk.timings_ms


def run(args: argparse.Namespace) -> int:
    from ..pipeline.policy import random_policy
    from ..sample import sample_observation

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = random_policy(args.model, device, dtype, layers=args.layers, tiny_vae=args.model.startswith("tiny"))
    if args.steps:
        policy.options = policy.options.updated(steps=args.steps)
    obs = sample_observation(0)
    plain = policy.infer(obs, seed=0).actions
    rows = []
    for d in args.delays:
        prefix = plain[:d]
        requests = {m: _request(obs, prefix, m) for m in MODES}
        for i in range(args.warmup):
            for m in MODES:
                policy.infer(requests[m], seed=i)
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        peaks: dict[str, int] = {m: 0 for m in MODES}
        stages: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for i in range(args.runs):
            for m in MODES:
                ms, peak, timings = _timed(policy, requests[m], 1000 + i, device)
                samples[m].append(ms)
                peaks[m] = max(peaks[m], peak)
                stages[m].append(timings)
        stats = {m: summarize(samples[m]) for m in MODES}
        row = {"kind": "latency", "mode": "prefix-cost", "model": args.model, "delay_steps": d,
               "steps": policy.options.steps,
               "requests": {m: {**stats[m], "peak_gib": peaks[m] / 2**30, "stages_ms": median_stages(stages[m])}
                            for m in MODES},
               "guided_over_inpaint": stats["guided"]["p50_ms"] / stats["inpaint"]["p50_ms"],
               "inpaint_over_none": stats["inpaint"]["p50_ms"] / stats["none"]["p50_ms"]}
        rows.append(row)
        print(f"{args.model} d = {d} ({row['steps']} steps): " + ", ".join(
            f"{m} {stats[m]['p50_ms']:.1f} ms ({stats[m]['ci95_p50_ms'][0]:.1f}-{stats[m]['ci95_p50_ms'][1]:.1f}"
            + (f", peak {peaks[m] / 2**30:.1f} GiB" if device.type == "cuda" else "") + ")" for m in MODES)
            + f"; guided / inpaint x{row['guided_over_inpaint']:.2f}", flush=True)
    result = {"kind": "latency", "mode": "prefix-cost", "model": args.model, "weights": "random",
              "engine": "eager reference (Policy)", "dtype": str(dtype), "layers": args.layers,
              "command": f"wamrt bench prefix-cost --model {args.model} --delays "
                         f"{' '.join(map(str, args.delays))} --warmup {args.warmup} --runs {args.runs}"
                         + (f" --layers {args.layers}" if args.layers else ""),
              **environment(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{utc_now()[:10]}-{result['git_sha'][:7]}-prefix-cost-{args.model}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"out": str(path)}))
    return 0
