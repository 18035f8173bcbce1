"""`wamrt bench parallel --world`: text -> video denoising steps per second on 1 / 2 / 4 / 8 GPUs of one host, in
the world layouts `cfg` (the two guidance branches on two GPUs), `ulysses` (one branch's sequence over n GPUs) and
`cfg+ulysses` (2 branches × n / 2 sequence shares), against one GPU in the same invocation.

Random weights at the real shapes (`random:SIZE`), the world engine on every rank (fused, compiled, one CUDA graph
per step), bf16; the request is vLLM-Omni's 720p workload without sound: 1280x720, 189 frames (~44,000 Generator
tokens per branch), guidance 6 at every step, flow shift 10, the stand-in tokenizer's 125 / 30 text tokens. Each
layout is started afresh (its worker processes, its weights); one warm-up request compiles and captures, then
`--runs` requests are timed step by step (the host clock at every step boundary, the device synchronised: what
`on_step` sees). The unit is a step: a 35-step request is ~35 of them plus the Reasoner prefill and the decode,
which no layout here splits. The floor of a step is its FLOPs at the H200's measured bf16 rate over the GPUs.

Writes one `kind: latency` JSON per layout (`mode: t2v720`, `parallel`, `gpus`, per-step `p50_ms` with its CI,
`steps_per_s`, `speedup_vs_1gpu`, `peak_mem_gib_per_gpu`) and `world-parallel.json` with all rows.
`--device cpu` runs the same plumbing with gloo on CPU processes (tiny models, a small clip; a dry run).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .stats import summarize

PROMPT = "A robot arm in a bright kitchen picks up a red apple from a wooden table and places it into a bowl."
PEAK_BF16_TFLOPS = 790.0  # performance.md: measured dense bf16 matmul rate of one H200
LAYOUTS = ("cfg", "ulysses", "cfg+ulysses")


def configurations(layouts: list[str], counts: list[int]) -> list[tuple[str, int, str | None]]:
    """(layout, GPUs, launcher mode) of each run, one GPU first (mode None): cfg at 2 GPUs only, ulysses at 2 and
    more, cfg+ulysses at 4 and more (even)."""
    out: list[tuple[str, int, str | None]] = [("single", 1, None)] if 1 in counts else []
    for n in sorted(c for c in counts if c > 1):
        for layout in layouts:
            if layout == "cfg" and n == 2:
                out.append(("cfg", 2, "cfg,ulysses"))  # 2 branches x 1 sequence share
            elif layout == "ulysses":
                out.append(("ulysses", n, "ulysses"))
            elif layout == "cfg+ulysses" and n >= 4 and n % 2 == 0:
                out.append(("cfg+ulysses", n, "cfg,ulysses"))
    return out


def _request(args: argparse.Namespace) -> dict[str, Any]:
    width, height = (int(v) for v in args.size.split("x"))
    return dict(prompt=PROMPT, negative_prompt="blurry, static", num_frames=args.frames, height=height, width=width,
                fps=24.0, steps=args.steps, guidance=6.0, shift=10.0, use_resolution_template=False,
                use_duration_template=False, decode=False)


def _time_steps(front: Any, args: argparse.Namespace, sync: Any) -> tuple[list[float], list[dict]]:
    """One untimed request (compile, capture), then `args.runs` requests: every step's time, and each request's
    stage timings."""
    steps_ms: list[float] = []
    stages: list[dict] = []
    for run in range(1 + args.world_runs):
        marks: list[float] = []

        def on_step(_i: int, _n: int, marks: list[float] = marks) -> None:
            sync()
            marks.append(time.perf_counter())

        sync()
        out = front.run(generator=torch.Generator().manual_seed(run), on_step=on_step, **_request(args))
        if run:  # the first step's time counts from the loop's start: denoise minus the later steps
            later = [1e3 * (b - a) for a, b in zip(marks, marks[1:], strict=False)]
            first = out.timings_ms["denoise"] - sum(later)
            steps_ms += [first, *later]
            stages.append({k: v for k, v in out.timings_ms.items() if not k.startswith("denoise_step")})
        del out
    return steps_ms, stages


def _single(args: argparse.Namespace, spec: Any) -> tuple[Any, Any]:
    from ..engine.world import WorldEngine
    from ..parallel.launch import build_policy, world_config

    dev = torch.device("cuda", 0) if spec.device.startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    policy = build_policy(spec, 0, dev)
    engine = WorldEngine(policy.model, policy.encoder, policy.tokenizer, world_config(spec), name=policy.name)
    return engine, dev


def _row(args: argparse.Namespace, env: dict, command: str, layout: str, gpus: int, steps_ms: list[float],
         stages: list[dict], peak: list, cfg: Any, gen_tokens: int) -> dict[str, Any]:
    from .flops import request_flops
    from .stats import median_stages

    summary = summarize(steps_ms)
    # a guided step's Generator FLOPs (both branches): two steps' request less one step's (the Reasoner runs once)
    step_flops = (request_flops(cfg, text=[125, 30], gen_tokens=gen_tokens, cfg_steps=[True, True])
                  - request_flops(cfg, text=[125, 30], gen_tokens=gen_tokens, cfg_steps=[True]))
    floor_ms = step_flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3 / gpus
    return {
        "kind": "latency", "mode": "t2v720" if (args.size, args.frames) == ("1280x720", 189) else "t2v",
        "command": command, **env, "model": args.model, "weights": "random",
        "recipe": "bf16" if args.device != "cpu" else "fp32", "parallel": layout, "gpus": gpus, "size": args.size,
        "frames": args.frames, "sound": False, "steps": args.steps, "guidance": 6.0, "unit": "denoising step",
        **summary, "steps_per_s": 1e3 / summary["p50_ms"], "runs": args.world_runs, "warmup": 1,
        "stages_ms": median_stages(stages), "peak_mem_gib": max((p for p in peak if p is not None), default=None),
        "peak_mem_gib_per_gpu": peak, "generator_tokens_per_branch": gen_tokens, "layers": cfg.num_hidden_layers,
        "step_tflop": step_flops / 1e12,
        "floor_ms": floor_ms, "ratio_to_floor": summary["p50_ms"] / floor_ms, "peer": None,
    }


def run_layouts(args: argparse.Namespace, out_dir: Path, env: dict, command: str, econf: dict) -> int:
    """The `--world` half of `bench.parallel.run` (which prepared the output folder, provenance and engine
    settings)."""
    from ..parallel import ParallelSpec, start
    from ..parallel.launch import model_config

    cpu = args.device == "cpu"
    counts = [int(c) for c in args.gpu_counts.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",")]
    if bad := [x for x in layouts if x not in LAYOUTS]:
        print(f"--layouts: unknown {bad} (known: {', '.join(LAYOUTS)})", file=sys.stderr)
        return 2
    visible = torch.cuda.device_count() if not cpu else max(counts)
    base = ParallelSpec("ulysses", f"random:{args.model}", device=args.device, engine=econf, layers=args.layers,
                        tiny_vae=args.tiny_vae)
    cfg = model_config(base)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    from .world import _generator_tokens

    req = _request(args)
    gen_tokens = _generator_tokens(cfg, args.frames, req["height"], req["width"])
    rows: list[dict] = []
    single_p50 = None
    for layout, n, mode in configurations(layouts, counts):
        name = f"{args.model}-{rows_mode(args)}-{layout}-{n}gpu.json"
        if n > visible:
            print(f"[{layout} x{n}] skipped: {visible} GPUs visible", flush=True)
            continue
        t_start = time.perf_counter()
        if mode is None:
            engine, dev = _single(args, base)
            steps_ms, stages = _time_steps(engine, args, lambda: engine._sync())
            peak = [torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None]
            del engine
        else:
            try:
                front = start(ParallelSpec(mode, base.model, world=n, device=args.device, engine=econf,
                                           layers=args.layers, tiny_vae=args.tiny_vae))
            except ValueError as e:  # a layout this model's heads do not divide
                print(f"[{layout} x{n}] skipped: {e}", flush=True)
                continue
            try:
                steps_ms, stages = _time_steps(front.world_front, args, front.world_front.engine._sync)
                peak = front.peak_memory_gib()
            finally:
                front.close()
        gc.collect()  # an engine and its captured graphs form a cycle (graph keep-alive -> engine)
        if not cpu:
            torch.cuda.empty_cache()
        row = _row(args, env, command, layout, n, steps_ms, stages, peak, cfg, gen_tokens)
        row["wall_s"] = time.perf_counter() - t_start
        if mode is None:
            single_p50 = row["p50_ms"]
        if single_p50 is not None:
            row["single_gpu_p50_ms"] = single_p50
            row["speedup_vs_1gpu"] = single_p50 / row["p50_ms"]
        rows.append(row)
        (out_dir / name).write_text(json.dumps(row, indent=2) + "\n")
        print(f"[{layout} x{n}] step p50 {row['p50_ms']:.1f} ms CI [{row['ci95_p50_ms'][0]:.1f}, "
              f"{row['ci95_p50_ms'][1]:.1f}] = {row['steps_per_s']:.3f} steps/s"
              + (f", x{row['speedup_vs_1gpu']:.2f} vs 1 GPU" if "speedup_vs_1gpu" in row else "")
              + f" | floor {row['floor_ms']:.1f} ms | peak {peak} GiB | {row['wall_s']:.0f}s wall -> {out_dir / name}",
              flush=True)
    (out_dir / "world-parallel.json").write_text(json.dumps({"command": command, **env, "rows": rows}, indent=2)
                                                 + "\n")
    return 0 if rows else 1


def rows_mode(args: argparse.Namespace) -> str:
    return "t2v720" if (args.size, args.frames) == ("1280x720", 189) else f"t2v-{args.size}-{args.frames}f"


__all__ = ["LAYOUTS", "configurations", "run_layouts"]
