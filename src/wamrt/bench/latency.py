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
from pathlib import Path

import torch

from ..engine import Engine
from ..ops.attention import measure_backends
from ..provenance import environment
from ..sample import sample_observation
from .catalog import ROWS
from .rows import RowSpec, engine_config, measure_row, print_row, release, time_requests
from .stats import median_stages, summarize
from .waterfall import plot as plot_waterfall


def run(args: argparse.Namespace) -> int:
    from ..pipeline.policy import random_policy
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
            try:
                engine = Engine.from_policy(policy, engine_config(dev, **{"attention": best, **flags}))
            except ValueError as e:  # a row whose kernels this machine lacks (flash-attn-4, quack): the others run
                print(f"[{args.model} {steps} steps] {row} skipped: {e}", flush=True)
                continue
            warm = args.warmup if row in args.full_rows else args.quick_warmup
            runs = args.runs if row in args.full_rows else args.quick_runs
            result = measure_row(engine, RowSpec(row, label, steps), args, env, command, warm, runs,
                                 peer_result=peer_result, attention_ms=attention_ms,
                                 trace_dir=out_dir if args.trace and row in (args.trace_rows or rows[-1:]) else None)
            rows_out.append(result)
            name = f"{args.model}-s{steps}-{row}.json"
            (out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
            print_row(result)
            del engine
            release(dev)
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
