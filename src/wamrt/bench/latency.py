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
from .rows import RowSpec, engine_config, measure_row, print_row, release, time_requests
from .stats import median_stages, summarize
from .waterfall import plot as plot_waterfall

ROWS: dict[str, tuple[str, dict]] = {
    "E0": ("eager reference: diffusers call pattern (Reasoner in every forward, SDPA enable_gqa, 33-frame VAE)",
           dict(attention="gqa", reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False,
                cuda_graph=False, vae_encode="diffusers")),
    "E1": ("+ attention backend (K/V heads expanded, fastest SDPA kernel)",
           dict(reuse_reasoner=False, vae_frames=33, batch_cfg=False, compile=False, cuda_graph=False,
                vae_encode="diffusers")),
    "E2": ("+ Reasoner K/V once per prompt (LRU) + frame-0 VAE",
           dict(batch_cfg=False, compile=False, cuda_graph=False, vae_encode="diffusers")),
    "E3": ("+ both CFG branches in one Generator pass",
           dict(compile=False, cuda_graph=False, vae_encode="diffusers")),
    "E4": ("+ fused QKV / gate-up + regional torch.compile + frame-0 VAE as 2D convolutions", dict(cuda_graph=False)),
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
    # E5 on cuDNN attention whichever kernel measured fastest (the comparison row for a new attention kernel).
    "E5-cudnn": ("E5 with cuDNN attention", dict(attention="cudnn")),
    # The layer tail's GEMMs with their elementwise work in quack epilogues where that measured faster (on the H200:
    # the MLP activation; engine/epilogues.py SM90_SITES). Needs quack-kernels.
    "E5-quack": ("E5 with fused-epilogue GEMMs (quack)", dict(epilogues="quack")),
    # ... and the server's prompt buckets: both CFG branches in one attention call per layer (no per-branch calls,
    # no output gather); what `wamrt serve --epilogues quack` runs (its --prompt-bucket defaults to 64).
    "E5-quack-bucket": ("E5-quack with prompts padded to 64-token buckets (one attention call per layer)",
                        dict(epilogues="quack", prompt_bucket=64)),
    # ... and both CFG branches in one flash-attn-4 call per layer: keys laid out [Generator | prefix | zeros], each
    # branch's key count read by the kernel (no per-branch calls, no output gather). Needs flash-attn-4. The rows
    # below force fa4 and pin the two later defaults off or on, so each compares one change in one run; where the
    # probe picks fa4, E5-quack equals E5-quack-heads-gqa.
    "E5-quack-lengths": ("E5-quack with both CFG branches in one flash-attn-4 call (per-branch key lengths)",
                         dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=False,
                              head_epilogue="inductor")),
    # ... and step K/V buffers at the model's K/V heads, flash-attn-4 sharing them across query heads (gqa_buffers).
    "E5-quack-gqa": ("E5-quack-lengths with K/V buffers at the K/V heads (GQA in the attention kernel)",
                     dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=True,
                          head_epilogue="inductor")),
    # ... or the Generator's per-head norms, RoPE and K/V stores in one Triton kernel (engine/qkv_epilogue.py) ...
    "E5-quack-heads": ("E5-quack-lengths with the q/k/v head epilogue in one Triton kernel",
                       dict(epilogues="quack", attention="fa4", cfg_attention="lengths", gqa_buffers=False,
                            head_epilogue="triton")),
    # ... or both (the defaults on fa4).
    "E5-quack-heads-gqa": ("E5-quack-heads with K/V buffers at the K/V heads",
                           dict(epilogues="quack", attention="fa4", cfg_attention="lengths", head_epilogue="triton",
                                gqa_buffers=True)),
    # The defaults on fa4 with the host waiting after the VAE encode and around the Reasoner prefill, as before
    # EngineConfig.overlap_encode (the comparison row for it).
    "E5-quack-heads-gqa-sync": ("E5-quack-heads-gqa with the host waiting for the VAE encode",
                                dict(epilogues="quack", attention="fa4", cfg_attention="lengths",
                                     head_epilogue="triton", gqa_buffers=True, overlap_encode=False)),
    # The shipped defaults with every row through the last layer (EngineConfig.last_layer_read_rows off: the
    # comparison row for it).
    "E5-quack-all-rows": ("E5-quack with every row through the last layer",
                          dict(epilogues="quack", last_layer_read_rows=False)),
    # E5 with diffusers' own encode of the conditioning frame (the comparison row for the 2D first-frame encode).
    "E5-vae-diffusers": ("E5 with diffusers' VAE encode of frame 0", dict(vae_encode="diffusers")),
}

# Opt-in rows: E5-autotune spends minutes autotuning at Nano, which the default waterfall run cannot afford.
DEFAULT_ROWS = [r for r in ROWS if r not in ("E5-bucket", "E5-bucket-mask", "E5-autotune", "E5-cudnn", "E5-quack",
                                             "E5-quack-bucket", "E5-quack-lengths", "E5-quack-gqa",
                                             "E5-quack-heads", "E5-quack-heads-gqa", "E5-quack-heads-gqa-sync",
                                             "E5-quack-all-rows", "E5-vae-diffusers")]


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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="nano", choices=["edge", "nano", "super", "tiny-qwen", "tiny-edge"],
                    help="tiny-* run the whole bench on CPU in seconds (smoke tests)")
    ap.add_argument("--layers", type=int, help="override the layer count (smoke tests)")
    ap.add_argument("--tiny-vae", action="store_true", help="tiny VAE instead of the Wan2.2 size (smoke tests)")
    ap.add_argument("--steps", type=int, nargs="+", default=[4])
    ap.add_argument("--rows", type=lambda s: [r for r in s.split(",") if r], default=DEFAULT_ROWS,
                    help=f"comma-separated, default {','.join(DEFAULT_ROWS)}; opt-in: "
                         f"{','.join(r for r in ROWS if r not in DEFAULT_ROWS)}")
    ap.add_argument("--other-steps-rows", type=lambda s: s.split(","), default=["E5"],
                    help="rows run for the second and later --steps values")
    ap.add_argument("--full-rows", type=lambda s: s.split(","), default=["E5"],
                    help="rows timed with --warmup/--runs; the others use --quick-warmup/--quick-runs")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--pace-hz", type=float, default=0.0,
                    help="start our requests on a clock of this rate (a robot's control loop, e.g. 15) instead of back "
                         "to back; recorded as pace_hz (the peer stays back to back)")
    ap.add_argument("--quick-warmup", type=int, default=3)
    ap.add_argument("--quick-runs", type=int, default=10)
    ap.add_argument("--peer", choices=["none", "diffusers"], default="none")
    ap.add_argument("--peer-all-steps", action="store_true", help="also run the peer for later --steps values")
    ap.add_argument("--peer-warmup", type=int, default=3)
    ap.add_argument("--peer-runs", type=int, default=10)
    ap.add_argument("--trace", action="store_true", help="profile one extra request of the last row (or --trace-rows)")
    ap.add_argument("--trace-rows", type=lambda s: [r for r in s.split(",") if r], default=[],
                    help="with --trace: the rows to profile (comma-separated), each in its own trace file")
    ap.add_argument("--lossy-rows", type=lambda s: [r for r in s.split(",") if r], default=[],
                    help="lossy rows after the exact ones (E6 gen-fp8, E7 +2 steps, E8 +CFG on the first step only; "
                         "E5-interval / E5-quack-interval: bf16, 4 steps, CFG on the first step only; the variants "
                         "in wamrt.bench.lossy.LOSSY_ROWS)")
    ap.add_argument("--quality", action="store_true",
                    help="with --lossy-rows: per-layer SQNR at full shape, chunk rel-L2 vs bf16, memory per recipe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="bench/results/latency")
