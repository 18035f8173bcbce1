"""`wamrt bench parallel`: latency of one request on 2 GPUs (CFG-parallel or tensor parallel).

Random weights at the real shapes, tier 480, DROID request, batch 1, the E5 engine (fused + compiled
+ whole-loop CUDA graph) on every rank. With `--baseline`, the same policy is first timed on one GPU
(rank 0's) in the same process, so the two p50s come from one session. `--serve-seconds S` then
also serves the parallel engine on a loopback `wamrt serve` app and drives it with one closed-loop
websocket lane (the serving latency). Writes `kind: latency` JSON files (../shared/docs/performance.md:
`gpus`, `parallel`) into `--out`.

`--device cpu` runs the same plumbing with gloo on the CPU (tiny models; no compile, no graphs).
`--world`: world generation's layouts instead (`bench.parallel_world`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..provenance import environment
from ..sample import sample_observation
from .flops import COMPUTE_FLOOR_MS, PRACTICAL_FLOOR_MS, TARGET_MS, request_flops
from .stats import median_stages, summarize

TEXT_TOKENS = {"cond": 125, "uncond": 30, "note": "stand-in tokenizer with performance.md's counts"}


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu":
        return dict(attention=args.attention or "auto", compile=False, cuda_graph=False)
    return dict(attention=args.attention or "cudnn", cuda_graph=not args.no_graph)


def _infer(policy: Any, observations: list, steps: int, i: int):
    return policy.infer(observations[i], steps=steps)


def _time(policy: Any, args: argparse.Namespace) -> tuple[dict, dict, float]:
    """Warm-up, then each request timed on the host clock (arrays in -> actions out), a different
    observation each time (made before timing), seeds from the server's default sequence."""
    t0 = time.perf_counter()
    observations = [sample_observation(i) for i in range(args.warmup + args.runs)]
    infer = partial(_infer, policy, observations, args.steps)
    for i in range(args.warmup):
        infer(i)
    totals, stages = [], []
    for i in range(args.warmup, args.warmup + args.runs):
        t = time.perf_counter()
        chunk = infer(i)
        totals.append(1e3 * (time.perf_counter() - t))
        stages.append(chunk.timings_ms)
    return summarize(totals), median_stages(stages), time.perf_counter() - t0


def _result(args: argparse.Namespace, env: dict, command: str, parallel: str, gpus: int, summary: dict,
            stages: dict, peak: list, econf: dict, cfg: Any, wall: float) -> dict:
    key = (args.model, args.steps)
    floor = COMPUTE_FLOOR_MS.get(key)
    flops = request_flops(cfg, text=[125, 30], gen_tokens=3092, cfg_steps=[True] * args.steps)
    out = {
        "kind": "latency", "command": command, **env, "model": args.model, "tier": 480, "steps": args.steps,
        "guidance": 3.0, "guidance_interval": None, "recipe": "bf16" if args.device != "cpu" else "fp32",
        "parallel": parallel, "gpus": gpus, "batch": 1, "weights": "random", **summary, "warmup": args.warmup,
        "floor_ms": floor, "practical_floor_ms": PRACTICAL_FLOOR_MS.get(key), "target_ms": TARGET_MS.get(key),
        "stages_ms": stages, "peak_mem_gib": max((p for p in peak if p is not None), default=None),
        "peak_mem_gib_per_gpu": peak, "peer": None, "engine": econf, "layers": cfg.num_hidden_layers,
        "text_tokens": TEXT_TOKENS, "generator_tokens": 3092, "request_tflop": flops / 1e12,
        "achieved_tflops": flops / 1e12 / (summary["p50_ms"] / 1e3),
        "ratio_to_floor": summary["p50_ms"] / floor if floor else None, "wall_s": wall,
    }
    if gpus > 1 and floor:
        out["floor_per_gpu_ms"] = floor / gpus
        out["ratio_to_floor_per_gpu"] = summary["p50_ms"] / (floor / gpus)
    return out


def _write(out_dir: Path, name: str, result: dict) -> None:
    (out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
    st = result["stages_ms"]
    print(f"[{result['model']} {result['steps']} steps] parallel={result['parallel']} gpus={result['gpus']} "
          f"p50 {result['p50_ms']:.1f} ms CI [{result['ci95_p50_ms'][0]:.1f}, {result['ci95_p50_ms'][1]:.1f}] "
          f"p99 {result['p99_ms']:.1f} | vae {st.get('vae_encode', 0):.1f} prefill {st.get('reasoner_prefill', 0):.1f} "
          f"denoise {st.get('denoise', 0):.1f} | peak {result['peak_mem_gib_per_gpu']} GiB | "
          f"{result['wall_s']:.0f}s wall -> {out_dir / name}", flush=True)


def _serve_check(policy: Any, seconds: float, steps: int) -> dict[str, Any]:
    """Serve the parallel engine on loopback; one closed-loop websocket lane for `seconds`."""
    try:
        from ..serving.config import ServeConfig
        from ..serving.server import ServerThread
        from .load import run_load
    except ImportError as e:  # the server stack is an extra
        return {"skipped": f"server stack missing: {e}"}
    config = ServeConfig(max_batch=1, warmup_requests=1, steps=steps)
    with ServerThread(policy, config) as server:
        summary = run_load(server.ws_url, lanes=1, seconds=seconds, warmup=2)
    return {k: summary[k] for k in ("requests", "throughput_rps", "p50_ms", "p90_ms", "p99_ms", "errors")}


def run(args: argparse.Namespace) -> int:
    from ..parallel import ParallelSpec, start
    from ..parallel.dist import no_multicast_env

    no_multicast_env()
    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = "wamrt bench parallel " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "parallel"]
                                                 else sys.argv[1:])
    econf = engine_config(args)
    if getattr(args, "world", False):
        from .parallel_world import run_layouts

        return run_layouts(args, out_dir, env, command, econf)
    spec = ParallelSpec(args.parallel, f"random:{args.model}", world=args.gpus, device=args.device, engine=econf,
                        layers=args.layers, tiny_vae=args.tiny_vae)
    cuda = args.device.startswith("cuda")
    results: dict[str, dict] = {}
    policy = None
    if args.baseline:
        if args.parallel != "cfg":
            print("--baseline: only with --parallel cfg (a tp model is a shard; Super does not fit one GPU)",
                  file=sys.stderr)
            return 2
        from ..engine import Engine, EngineConfig
        from ..parallel.launch import build_policy

        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        policy = build_policy(spec, 0, dev)
        engine = Engine.from_policy(policy, EngineConfig(**econf))
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        summary, stages, wall = _time(engine, args)
        peak = [torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None]
        res = _result(args, env, command, "none", 1, summary, stages, peak, econf, policy.model.config, wall)
        results["none"] = res
        _write(out_dir, f"{args.model}-s{args.steps}-single.json", res)
        del engine
        gc.collect()  # the engine and its captured graphs form a cycle (graph keep-alive -> engine)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    t_start = time.perf_counter()
    front = start(spec, policy=policy)
    try:
        start_s = time.perf_counter() - t_start
        full_cfg = getattr(getattr(front.policy.model, "tp", None), "full_config", None) or front.policy.model.config
        summary, stages, wall = _time(front, args)
        peak = front.peak_memory_gib()
        res = _result(args, env, command, args.parallel, args.gpus, summary, stages, peak, econf, full_cfg, wall)
        res["start_s"] = start_s
        if "none" in results:
            base = results["none"]["p50_ms"]
            res["single_gpu_p50_ms"] = base
            res["ratio_to_single_gpu"] = summary["p50_ms"] / base
            res["single_gpu_result"] = f"{args.model}-s{args.steps}-single.json"
        if args.serve_seconds > 0:
            res["serving"] = _serve_check(front, args.serve_seconds, args.steps)
            print(f"serving (1 websocket lane, {args.serve_seconds:.0f} s): {res['serving']}", flush=True)
        _write(out_dir, f"{args.model}-s{args.steps}-{args.parallel}.json", res)
        if "ratio_to_single_gpu" in res:
            print(f"{args.parallel} p50 / single-GPU p50 = {res['ratio_to_single_gpu']:.3f}", flush=True)
        if "ratio_to_floor_per_gpu" in res:
            print(f"p50 / (bf16 floor / {args.gpus}) = {res['ratio_to_floor_per_gpu']:.3f}", flush=True)
    finally:
        front.close()
    return 0
