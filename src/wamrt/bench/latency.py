"""`wamrt bench latency`: the cumulative waterfall E0 -> E5 on random full-size weights.

Each row keeps the previous rows' techniques and adds one. Every request is timed end to end on the
host (observation arrays in -> action array on host), after warm-up, with a different observation each
time and the same instruction (an episode). Results: one JSON file per row in performance.md's
schema, plus a PNG waterfall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from ..engine import Engine, EngineConfig
from ..ops.attention import measure_backends
from ..provenance import environment
from ..sample import sample_observation
from .flops import (
    COMPUTE_FLOOR_MS,
    FP8_COMPUTE_FLOOR_MS,
    FP8_PRACTICAL_FLOOR_MS,
    FP8_TARGET_MS,
    PRACTICAL_FLOOR_MS,
    TARGET_MS,
    request_flops,
)
from .stats import median_stages, summarize

ROWS: dict[str, tuple[str, dict]] = {
    "E0": ("eager reference: diffusers call pattern (Reasoner in every forward, SDPA enable_gqa, 33-frame VAE)",
           dict(attention="gqa", reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False,
                cuda_graph=False)),
    "E1": ("+ attention backend (K/V heads expanded, fastest SDPA kernel)",
           dict(reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False, cuda_graph=False)),
    "E2": ("+ Reasoner K/V once per prompt (LRU) + frame-0 VAE", dict(batch_cfg=False, compile=False,
                                                                    cuda_graph=False)),
    "E3": ("+ both CFG branches in one Generator pass", dict(compile=False, cuda_graph=False)),
    "E4": ("+ fused QKV / gate-up + regional torch.compile", dict(cuda_graph=False)),
    "E5": ("+ whole denoise loop as one CUDA graph", dict()),
    # Alternative to E5 (not cumulative): the CFG branches' attention as one masked call.
    "E5-mask": ("E5 with one masked attention call for both CFG branches", dict(cfg_attention="mask")),
    # What a server pays for one graph per prompt-length bucket instead of one per exact length combination.
    "E5-bucket": ("E5 with prompts padded to 64-token buckets (zero keys, log-sum-exp rescale)",
                  dict(prompt_bucket=64)),
    "E5-bucket-mask": ("E5 with prompts padded to 64-token buckets (masked kernel)",
                       dict(prompt_bucket=64, bucket_attention="mask")),
    # Triton GEMM templates autotuned against cuBLAS, elementwise epilogues fused into the winners.
    "E5-autotune": ("E5 compiled with mode max-autotune-no-cudagraphs",
                    dict(compile_mode="max-autotune-no-cudagraphs")),
}

# Opt-in rows: E5-autotune spends minutes autotuning at Nano, which the default waterfall run cannot afford.
DEFAULT_ROWS = [r for r in ROWS if r not in ("E5-bucket", "E5-bucket-mask", "E5-autotune")]


def time_requests(fn, warmup: int, runs: int) -> tuple[list[float], list[dict]]:
    for i in range(warmup):
        fn(i)
    totals, stages = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        chunk = fn(warmup + i)
        totals.append(1e3 * (time.perf_counter() - t0))
        stages.append(chunk.timings_ms if hasattr(chunk, "timings_ms") else chunk)
    return totals, stages


def kernel_split(prof) -> dict[str, float]:
    """GPU kernel time (ms) by class, from a torch.profiler run."""
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if not t or evt.device_type.name != "CUDA":
            continue
        name = evt.key.lower()
        if any(s in name for s in ("sdpa", "flash", "fmha", "attention")):
            split["attention"] += t / 1e3
        elif any(s in name for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
            split["gemm"] += t / 1e3
        else:
            split["other"] += t / 1e3
    return split


def plot_waterfall(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["row"] for r in rows] + (["diffusers"] if rows and rows[0].get("peer") else [])
    vals = [r["p50_ms"] for r in rows] + ([rows[0]["peer"]["p50_ms"]] if rows and rows[0].get("peer") else [])
    errs = [[r["p50_ms"] - r["ci95_p50_ms"][0] for r in rows], [r["ci95_p50_ms"][1] - r["p50_ms"] for r in rows]]
    if len(vals) > len(rows):
        errs = [e + [0.0] for e in errs]
    colors = ["#dd8452" if r.get("lossy") else "#4c72b0" for r in rows] + ["#c44e52"] * (len(vals) - len(rows))
    names[: len(rows)] = [f"{r['row']}\n{r['steps']} st" + ("\nlossy" if r.get("lossy") else "") for r in rows]
    ax.bar(names, vals, yerr=errs, color=colors, capsize=3)
    for x, v in enumerate(vals):
        ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    r0 = rows[0]
    for key, style, label in (("floor_ms", ":", "compute floor"), ("practical_floor_ms", "--", "practical floor"),
                              ("target_ms", "-", "target")):
        if r0.get(key):
            ax.axhline(r0[key], linestyle=style, color="k", linewidth=0.8, label=f"{label} {r0[key]:.0f} ms")
    ax.set_ylabel("end-to-end p50 latency (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from ..pipeline.random_weights import random_policy
    from .peer_diffusers import DiffusersPeer, diffusers_twin

    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {list(ROWS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = "wamrt bench latency " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "latency"] else sys.argv[1:])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    policy = random_policy(args.model, dev, dtype, layers=args.layers, tiny_vae=args.tiny_vae)
    cfg = policy.model.config
    obs0 = sample_observation(0)
    prep_geom = None
    peer = None
    if args.peer == "diffusers":
        peer_model = diffusers_twin(policy.model)  # before fusion: shares the unfused weights
    rows_out: list[dict] = []
    attention_ms = None
    if dev.type == "cuda":
        g_tokens = 3092
        attention_ms = measure_backends((2, cfg.num_attention_heads, g_tokens, cfg.head_dim), cfg.num_key_value_heads,
                                        g_tokens + 125, dtype=torch.bfloat16, device=dev)
        best = min(attention_ms, key=attention_ms.get)
        print(f"generator attention per call (ms): {attention_ms} -> {best}", flush=True)
    else:
        best = "auto"
    for steps in args.steps:
        rows_out = []
        peer_result = None
        if args.peer == "diffusers" and (steps == args.steps[0] or args.peer_all_steps):
            peer = DiffusersPeer(peer_model, policy.encoder, steps=steps, guidance=3.0, shift=5.0)
            from ..pipeline.canvas import compose_droid_canvas, pad_to_bucket

            padded = pad_to_bucket(compose_droid_canvas(obs0))
            canvas = torch.from_numpy(padded.pixels).to(dev)
            cond = list(policy.tokenizer.encode("x").text_ids)
            uncond = list(policy.tokenizer.encode("").text_ids)
            gen = torch.Generator(device=dev).manual_seed(0)
            ptimes, pstages = time_requests(lambda i: peer.run(canvas, cond, uncond, padded.image_size[2:], gen),
                                            args.peer_warmup, args.peer_runs)
            peer_result = {"name": "diffusers 0.42.1 (own loop + 33-frame VAE encode)", **summarize(ptimes),
                           "stages_ms": median_stages(pstages)}
            print(f"[{args.model} {steps} steps] peer diffusers p50 {peer_result['p50_ms']:.1f} ms", flush=True)
        rows = args.rows if steps == args.steps[0] else [r for r in args.rows if r in args.other_steps_rows]
        for row in rows:
            label, flags = ROWS[row]
            engine = Engine.from_policy(policy, engine_config(dev, attention=best, **flags))
            warm = args.warmup if row in args.full_rows else args.quick_warmup
            runs = args.runs if row in args.full_rows else args.quick_runs
            result = measure_row(engine, RowSpec(row, label, steps), args, env, command, warm, runs,
                                 peer_result=peer_result, attention_ms=attention_ms,
                                 trace_dir=out_dir if args.trace and row == rows[-1] else None)
            rows_out.append(result)
            name = f"{args.model}-s{steps}-{row}.json"
            (out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
            print_row(result)
            del engine
        if rows_out:
            try:
                plot_waterfall(rows_out, out_dir / f"waterfall-{args.model}-s{steps}.png",
                               f"Cosmos 3 {args.model} DROID policy, tier 480, {steps} steps, bf16, random weights, "
                               f"{env.get('gpu')}")
            except ImportError:
                print("matplotlib missing: no PNG", flush=True)
    if args.lossy_rows:
        from .lossy import run_lossy_rows

        run_lossy_rows(policy, args, env, command, best, attention_ms, out_dir)
    print(json.dumps({"model": args.model, "rows": [{k: r[k] for k in ("row", "steps", "p50_ms")} for r in rows_out]}))
    del prep_geom
    return 0


def engine_config(device: torch.device, **flags) -> EngineConfig:
    """CPU smoke runs keep every technique but the CUDA-only ones (compile is slow there, graphs absent)."""
    if device.type != "cuda":
        flags.update(compile=False, cuda_graph=False)
    return EngineConfig(**flags)


@dataclass(frozen=True)
class RowSpec:
    row: str
    label: str
    steps: int
    recipe: str = "bf16"
    guidance_interval: tuple[float, float] | None = None
    lossy: bool = False


def measure_row(engine: Engine, spec: RowSpec, args: argparse.Namespace, env: dict, command: str, warm: int,
                runs: int, *, peer_result: dict | None = None, attention_ms: dict | None = None,
                trace_dir: Path | None = None) -> dict:
    """Time one waterfall row on a built engine; returns its result record (performance.md schema)."""
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    econf = engine.config
    t_build = time.perf_counter()
    # Observations are made before timing (arrays in -> actions out); seeds follow the server's
    # default sequence, as a robot client that sends none gets.
    observations = [sample_observation(i) for i in range(warm + runs)]
    overrides = {"steps": spec.steps}
    if spec.guidance_interval is not None:
        overrides["guidance_interval"] = spec.guidance_interval
    totals, stages = time_requests(partial(_infer, engine, observations, overrides), warm, runs)
    summary = summarize(totals)
    timesteps = replace(engine.options, **overrides).make_schedule().timesteps
    from ..sampler import guidance_active

    cfg_steps = guidance_active(timesteps, spec.guidance_interval)
    cfg = engine.model.config
    flops = request_flops(cfg, text=[125, 30], gen_tokens=3092, cfg_steps=cfg_steps,
                          reasoner_once=econf.reuse_reasoner)
    fp8 = spec.recipe != "bf16"
    key = (args.model, spec.steps)
    floor = (FP8_COMPUTE_FLOOR_MS if fp8 else COMPUTE_FLOOR_MS).get(key)
    practical = (FP8_PRACTICAL_FLOOR_MS if fp8 else PRACTICAL_FLOOR_MS).get(key)
    target = (FP8_TARGET_MS if fp8 else TARGET_MS).get(key) if spec.guidance_interval is None else None
    result = {
        "kind": "latency", "command": command, **env, "model": args.model, "tier": 480, "steps": spec.steps,
        "guidance": 3.0, "guidance_interval": list(spec.guidance_interval) if spec.guidance_interval else None,
        "recipe": spec.recipe, "lossy": spec.lossy, "parallel": "none", "gpus": 1,
        "batch": 1, "weights": "random", **summary, "warmup": warm,
        "floor_ms": floor, "practical_floor_ms": practical, "target_ms": target,
        "stages_ms": median_stages(stages),
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "peer": None if peer_result is None else {"name": peer_result["name"], "p50_ms": peer_result["p50_ms"],
                                                  "ci95_p50_ms": peer_result["ci95_p50_ms"],
                                                  "stages_ms": peer_result["stages_ms"]},
        "row": spec.row, "label": spec.label, "engine": asdict(econf), "layers": cfg.num_hidden_layers,
        "text_tokens": {"cond": 125, "uncond": 30, "note": "stand-in tokenizer with performance.md's counts"},
        "generator_tokens": 3092, "request_tflop": flops / 1e12,
        "achieved_tflops": flops / 1e12 / (summary["p50_ms"] / 1e3),
        "ratio_to_floor": summary["p50_ms"] / floor if floor else None,
        "ratio_to_target": summary["p50_ms"] / target if target else None,
        "attention_backend_ms": attention_ms, "kv_cache": {"hits": engine.kv_cache.hits,
                                                           "misses": engine.kv_cache.misses},
        "row_wall_s": time.perf_counter() - t_build,
    }
    if peer_result is not None:
        result["speedup_vs_peer"] = peer_result["p50_ms"] / summary["p50_ms"]
    if trace_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.infer(sample_observation(10_000), seed=1, **overrides)
        trace = trace_dir / f"trace-{args.model}-s{spec.steps}-{spec.row}.json"
        prof.export_chrome_trace(str(trace))
        result["kernel_split_ms"] = kernel_split(prof)
        print(f"kernel split (ms): {result['kernel_split_ms']} -> {trace}", flush=True)
    return result


def _infer(engine: Engine, observations: list, overrides: dict, i: int):
    return engine.infer(observations[i], **overrides)


def print_row(r: dict) -> None:
    st = r["stages_ms"]
    print(f"[{r['model']} {r['steps']} steps] {r['row']} ({r['recipe']}) p50 {r['p50_ms']:.1f} ms "
          f"CI [{r['ci95_p50_ms'][0]:.1f}, {r['ci95_p50_ms'][1]:.1f}] p99 {r['p99_ms']:.1f} "
          f"| vae {st.get('vae_encode', 0):.1f} prefill {st.get('reasoner_prefill', 0):.1f} "
          f"denoise {st.get('denoise', 0):.1f} | {r['achieved_tflops']:.0f} TFLOP/s "
          f"| x{r.get('speedup_vs_peer', float('nan')):.2f} vs peer | target {r['target_ms']} "
          f"| peak {r['peak_mem_gib'] or 0:.1f} GiB | {r['row_wall_s']:.0f}s wall", flush=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="nano", choices=["edge", "nano", "super", "tiny-qwen", "tiny-edge"],
                    help="tiny-* run the whole bench on CPU in seconds (smoke tests)")
    ap.add_argument("--layers", type=int, help="override the layer count (smoke tests)")
    ap.add_argument("--tiny-vae", action="store_true", help="tiny VAE instead of the Wan2.2 size (smoke tests)")
    ap.add_argument("--steps", type=int, nargs="+", default=[4])
    ap.add_argument("--rows", type=lambda s: s.split(","), default=DEFAULT_ROWS,
                    help=f"comma-separated, default {','.join(DEFAULT_ROWS)}; opt-in: "
                         f"{','.join(r for r in ROWS if r not in DEFAULT_ROWS)}")
    ap.add_argument("--other-steps-rows", type=lambda s: s.split(","), default=["E5"],
                    help="rows run for the second and later --steps values")
    ap.add_argument("--full-rows", type=lambda s: s.split(","), default=["E5"],
                    help="rows timed with --warmup/--runs; the others use --quick-warmup/--quick-runs")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--quick-warmup", type=int, default=3)
    ap.add_argument("--quick-runs", type=int, default=10)
    ap.add_argument("--peer", choices=["none", "diffusers"], default="none")
    ap.add_argument("--peer-all-steps", action="store_true", help="also run the peer for later --steps values")
    ap.add_argument("--peer-warmup", type=int, default=3)
    ap.add_argument("--peer-runs", type=int, default=10)
    ap.add_argument("--trace", action="store_true", help="profile one extra request of the last row")
    ap.add_argument("--lossy-rows", type=lambda s: [r for r in s.split(",") if r], default=[],
                    help="lossy rows after the exact ones (E6 gen-fp8, E7 +2 steps, E8 +CFG on the first step only)")
    ap.add_argument("--quality", action="store_true",
                    help="with --lossy-rows: per-layer SQNR at full shape, chunk rel-L2 vs bf16, memory per recipe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="bench/results/latency")
