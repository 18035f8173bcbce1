"""One timed waterfall row on a built engine, shared by the exact rows (`latency`) and the lossy ones
(`lossy`): its engine config, timing, result record (performance.md's schema) and console line (the PNG:
`waterfall.plot`).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from ..engine import Engine, EngineConfig
from ..engine.layer_path import CUBLASLT_WORKSPACE_ENV
from ..provenance import utc_now
from ..sample import sample_observation
from .flops import (
    COMPUTE_FLOOR_MS,
    FP8_COMPUTE_FLOOR_MS,
    FP8_PRACTICAL_FLOOR_MS,
    FP8_TARGET_MS,
    PRACTICAL_FLOOR_MS,
    TARGET_MS,
    guidance_share,
    request_flops,
)
from .stats import median_stages, summarize
from .timeline import gpu_timeline, kernel_intervals


def time_requests(fn, warmup: int, runs: int, pace_hz: float = 0.0) -> tuple[list[float], list[dict]]:
    """Each request's wall time (ms) and stages, warm-up excluded. Back to back by default; with `pace_hz` a request
    starts on every tick of that clock, as a robot's control loop sends them (one that overruns its tick delays the
    next, which then starts at once). The wait is not timed. Paced, the GPU idles between requests: at Edge E7 it
    runs below its power cap, which back-to-back requests hold it at."""
    period = 1.0 / pace_hz if pace_hz > 0 else 0.0
    tick = time.perf_counter()

    def wait_for_tick() -> None:
        nonlocal tick
        if period:
            time.sleep(max(0.0, tick - time.perf_counter()))
            tick = max(tick + period, time.perf_counter())

    for i in range(warmup):
        wait_for_tick()
        fn(i)
    totals, stages = [], []
    for i in range(runs):
        wait_for_tick()
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
        if name.startswith("triton_"):  # Inductor's fused elementwise / norm kernels; their names list the ops
            split["other"] += t / 1e3  # they fuse around, e.g. "..._add_gemm_act_mean_..." is a norm, not a GEMM
        elif any(s in name for s in ("sdpa", "flash", "fmha", "attention")):
            split["attention"] += t / 1e3
        elif any(s in name for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
            split["gemm"] += t / 1e3
        else:
            split["other"] += t / 1e3
    return split


def top_kernels(prof, n: int = 30) -> list[dict]:
    """The n GPU kernels with the most total time in a torch.profiler run: name (cut to 120 characters), ms, calls."""
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if t and evt.device_type.name == "CUDA":
            rows.append({"kernel": evt.key[:120], "ms": t / 1e3, "calls": evt.count})
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def release(device: torch.device) -> None:
    """After a row's `del engine`: collect it (reference cycles keep its graphs and K/V arena alive otherwise, and
    each row's peak memory would count every earlier row's engine) and return the cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    pace_hz = getattr(args, "pace_hz", 0.0)
    timed_from = utc_now("milliseconds")
    totals, stages = time_requests(partial(_infer, engine, observations, overrides), warm, runs, pace_hz)
    timed_to = utc_now("milliseconds")
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
    if not all(cfg_steps):  # the tables assume CFG at every step: scale them to the steps that run both branches
        share = guidance_share(cfg, cfg_steps, reasoner_once=econf.reuse_reasoner)
        floor, practical = (None if f is None else f * share for f in (floor, practical))
    target = (FP8_TARGET_MS if fp8 else TARGET_MS).get(key) if spec.guidance_interval is None else None
    result = {
        "kind": "latency", "command": command, **env, "model": args.model, "tier": 480, "steps": spec.steps,
        "guidance": 3.0, "guidance_interval": list(spec.guidance_interval) if spec.guidance_interval else None,
        "recipe": spec.recipe, "lossy": spec.lossy, "parallel": "none", "gpus": 1,
        "batch": 1, "weights": "random", **summary, "warmup": warm, "pace_hz": pace_hz or None,
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
        # the warm-up and timed requests' wall window: scripts/gpu_clocks.py --rows reads the row's clock samples in it
        "timed_utc": [timed_from, timed_to],
        # in force while the row ran (EngineConfig.workspace_free_gemms sets it to 0 unless the environment named one)
        "cublaslt_workspace_kib": os.environ.get(CUBLASLT_WORKSPACE_ENV),
    }
    if peer_result is not None:
        result["speedup_vs_peer"] = peer_result["p50_ms"] / summary["p50_ms"]
    if trace_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.infer(sample_observation(10_000), seed=1, **overrides)
        trace = trace_dir / f"trace-{args.model}-s{spec.steps}-{spec.row}.json.gz"  # torch gzips by suffix
        prof.export_chrome_trace(str(trace))
        result["kernel_split_ms"] = kernel_split(prof)
        result["kernel_top_ms"] = top_kernels(prof)
        result["gpu_timeline_ms"] = gpu_timeline(kernel_intervals(prof))
        line = result["gpu_timeline_ms"]
        print(f"kernel split (ms): {result['kernel_split_ms']}; GPU span {line['span_ms']:.1f}, busy "
              f"{line['busy_ms']:.1f}, idle {line['idle_ms']:.1f} in {line['gap_count']} gaps -> {trace}", flush=True)
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
