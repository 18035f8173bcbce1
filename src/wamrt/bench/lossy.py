"""The lossy waterfall rows (E6 gen-fp8, E7 + 2 steps, E8 + CFG on the first step only) and what
they cost in quality: per-layer SQNR of every swapped linear at full shape, the action chunk's
relative L2 against bf16 with the same observation and noise, and weight memory per recipe.

They run after the exact rows, on the same random weights: the model is quantized in place, so the
bf16 reference chunks are computed first.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine
from ..model import Cosmos3Transformer
from ..pipeline.policy import Policy
from ..quant import RECIPES, failing, layer_sqnr, quantize_model, unexercised
from ..quant.sqnr import SQNR_BAR_DB
from ..sample import sample_observation
from .rows import RowSpec, engine_config, measure_row, print_row, release
from .waterfall import plot as plot_waterfall

# row -> (label, steps, recipe, CFG on the first step only, engine flags)
LOSSY_ROWS: dict[str, tuple[str, int, str, bool, dict]] = {
    "E6": ("lossy: + gen-fp8 (Generator linears fp8 e4m3 W8A8)", 4, "gen-fp8", False, {}),
    "E7": ("lossy: + 2 sampling steps", 2, "gen-fp8", False, {}),
    "E8": ("lossy: + CFG on the first step only (guidance interval)", 2, "gen-fp8", True, {}),
    # The exact engine with CFG on the first step only: no fp8, no fewer steps. The one lossy lever the trained
    # panda-droid's closed-loop gate passed (179 vs 178 of 200, bench/results/rollout/2026-12-02-8fc9a24f-...), so
    # the fastest setting with a passing gate; steps 2-4 run the conditional branch alone.
    "E5-interval": ("lossy: E5 with CFG on the first step only (bf16, 4 steps)", 4, "bf16", True, {}),
    "E5-quack-interval": ("lossy: E5-quack with CFG on the first step only (bf16, 4 steps)", 4, "bf16", True,
                          {"epilogues": "quack"}),
    # E6 with Inductor's kernels for the fp8 input quantizations (the comparison row for engine/fp8_fusion.py).
    "E6-inductor": ("E6 with Inductor's kernels for the fp8 input quantizations", 4, "gen-fp8", False,
                    {"fp8_quantize": "inductor"}),
}
# E6 / E7 with this two fa4 defaults pinned off or on, each compared in one run: step K/V buffers at the model's
# K/V heads (EngineConfig.gqa_buffers) and the q/k/v head epilogue in one Triton kernel (EngineConfig.head_epilogue).
# "-inductor-heads" is E6 / E7 before both; "-heads-gqa" is what E6 / E7 run by default where the probe picks fa4.
_PINNED = (
    ("inductor-heads", "repeated-head K/V buffers and Inductor's q/k/v head epilogue",
     {"gqa_buffers": False, "head_epilogue": "inductor"}),
    ("gqa", "K/V buffers at the K/V heads", {"gqa_buffers": True, "head_epilogue": "inductor"}),
    ("heads", "the q/k/v head epilogue in one kernel", {"gqa_buffers": False, "head_epilogue": "triton"}),
    ("heads-gqa", "K/V buffers at the K/V heads and the q/k/v head epilogue in one kernel",
     {"gqa_buffers": True, "head_epilogue": "triton"}),
)
LOSSY_ROWS.update({f"{row}-{suffix}": (f"{row} with {what}", steps, "gen-fp8", False, flags)
                   for suffix, what, flags in _PINNED for row, steps in (("E6", 4), ("E7", 2))})
# E6 / E7 with the host waiting for the VAE encode (EngineConfig.overlap_encode off: the comparison rows for it).
LOSSY_ROWS.update({f"{row}-sync": (f"{row} with the host waiting for the VAE encode", steps, "gen-fp8", False,
                                   {"overlap_encode": False}) for row, steps in (("E6", 4), ("E7", 2))})
# E6 / E7 with the host padding the canvas and a pageable upload (EngineConfig.canvas_on_device off: the comparison
# rows for it).
LOSSY_ROWS.update({f"{row}-host-canvas": (f"{row} with the canvas padded on the host", steps, "gen-fp8", False,
                                          {"canvas_on_device": False}) for row, steps in (("E6", 4), ("E7", 2))})
# E6 / E7 with some or all of the fused layer's fp8 GEMMs on our Triton TMA kernel (EngineConfig.fp8_triton_gemms;
# ops/fp8_gemm.py) instead of cuBLAS.
_TRITON_GEMMS = (("triton-gemms", "every fp8 GEMM on the Triton kernel", ("qkv", "out", "up", "down")),
                 ("triton-mlp", "the MLP's fp8 GEMMs on the Triton kernel", ("up", "down")),
                 ("triton-up", "the up-projection on the Triton kernel", ("up",)),
                 ("triton-qkv-heads", "the q/k/v GEMM with the head epilogue inside, the MLP's GEMMs on Triton",
                  ("qkv_heads", "up", "down")))
LOSSY_ROWS.update({f"{row}-{suffix}": (f"{row} with {what}", steps, "gen-fp8", False,
                                        {"fp8_triton_gemms": sites, "fp8_fast_accum": False})
                   for suffix, what, sites in _TRITON_GEMMS for row, steps in (("E6", 4), ("E7", 2))})
# E6 / E7 with every row through the last layer (EngineConfig.last_layer_read_rows off: the comparison rows).
LOSSY_ROWS.update({f"{row}-all-rows": (f"{row} with every row through the last layer", steps, "gen-fp8", False,
                                       {"last_layer_read_rows": False}) for row, steps in (("E6", 4), ("E7", 2))})
# E6 / E7 with cuBLAS's fp8 fast accumulation (EngineConfig.fp8_fast_accum, the default since its 1ba1cea timing) on or
# off: the Triton rows' accumulation on cuBLAS, and the comparison rows for it.
LOSSY_ROWS.update({f"{row}-fast-accum": (f"{row} with cuBLAS's fp8 fast accumulation", steps, "gen-fp8", False,
                                         {"fp8_fast_accum": True}) for row, steps in (("E6", 4), ("E7", 2))})
LOSSY_ROWS.update({f"{row}-precise-accum": (f"{row} with cuBLAS's fp8 accumulation promoted to fp32", steps, "gen-fp8",
                                            False, {"fp8_fast_accum": False}) for row, steps in (("E6", 4), ("E7", 2))})
# ... and with the down-projection on the Triton kernel (faster than either cuBLAS mode at K = 9,216 / 12,288).
LOSSY_ROWS.update({f"{row}-fast-triton-down": (f"{row} with cuBLAS's fp8 fast accumulation and the down-projection "
                                               "on the Triton kernel", steps, "gen-fp8", False,
                                               {"fp8_fast_accum": True, "fp8_triton_gemms": ("down",)})
                   for row, steps in (("E6", 4), ("E7", 2))})
QUALITY_REQUESTS = 4  # observations (and seeds) every lossy configuration is compared on


def first_step_interval(policy: Policy, steps: int) -> tuple[float, float]:
    """A guidance interval that enables CFG at the first timestep only (the interval is strict)."""
    ts = replace(policy.options, steps=steps).make_schedule().timesteps.tolist()
    return (float(ts[1]), float(ts[0]) + 1.0)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def weight_gib_per_recipe(model: Cosmos3Transformer) -> dict[str, float]:
    """Bytes of parameters + buffers of the model under each recipe (built on the meta device)."""
    out = {}
    for name in ["bf16", *RECIPES]:
        with torch.device("meta"):
            m = Cosmos3Transformer(model.config).to(torch.bfloat16)
        m.time_embedder.float()
        if name != "bf16":
            quantize_model(m, name)
        tensors = [*m.parameters(), *m.buffers()]
        out[name] = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    return out


def _chunks(engine: Engine, overrides: dict) -> list[np.ndarray]:
    return [engine.infer(sample_observation(500 + i), seed=1000 + i, **overrides).actions
            for i in range(QUALITY_REQUESTS)]


def run_lossy_rows(policy: Policy, args: argparse.Namespace, env: dict, command: str, attention: str,
                   attention_ms: dict | None, out_dir: Path) -> list[dict]:
    dev = policy.device
    rows = [r for r in args.lossy_rows if r in LOSSY_ROWS]
    unknown = sorted(set(args.lossy_rows) - set(LOSSY_ROWS))
    if unknown:
        raise SystemExit(f"unknown lossy rows {unknown}; known: {list(LOSSY_ROWS)}")
    specs = {}
    for row in rows:
        label, steps, recipe, first_only, _ = LOSSY_ROWS[row]
        specs[row] = RowSpec(row, label, steps, recipe, first_step_interval(policy, steps) if first_only else None,
                             lossy=True)

    def overrides(spec: RowSpec) -> dict:
        o = {"steps": spec.steps}
        if spec.guidance_interval is not None:
            o["guidance_interval"] = spec.guidance_interval
        return o

    quality: dict = {}
    if args.quality:
        # bf16 references with the exact engine (E5), for each lossy configuration and for the 4-step baseline.
        engine = Engine.from_policy(policy, engine_config(dev, attention=attention))
        refs = {"baseline": _chunks(engine, {"steps": 4})}
        for row, spec in specs.items():
            refs[row] = _chunks(engine, overrides(spec))
        # Scale of the differences: the same request with another noise seed.
        other = [engine.infer(sample_observation(500 + i), seed=2000 + i, steps=4).actions
                 for i in range(QUALITY_REQUESTS)]
        quality["bf16_other_seed_rel_l2"] = float(np.mean([rel_l2(o, r) for o, r in zip(other, refs["baseline"],
                                                                                          strict=True)]))
        del engine
        quality["weight_gib"] = weight_gib_per_recipe(policy.model)
        if any(spec.recipe != "bf16" for spec in specs.values()):  # the SQNR table's reference (a Nano is 27 GiB)
            reference = copy.deepcopy(policy.model)
    torch.cuda.empty_cache() if dev.type == "cuda" else None

    results = []

    def measure(row: str, spec: RowSpec) -> None:
        engine = Engine.from_policy(policy, engine_config(dev, attention=attention, **LOSSY_ROWS[row][4]))
        result = measure_row(engine, spec, args, env, command, args.warmup, args.runs, attention_ms=attention_ms,
                             trace_dir=out_dir if args.trace and row in (args.trace_rows or rows[:1]) else None)
        if args.quality:
            got = _chunks(engine, overrides(spec))
            result["quality"] = {
                "rel_l2_vs_bf16_same_config": float(np.mean([rel_l2(g, r) for g, r in zip(got, refs[row],
                                                                                        strict=True)])),
                "rel_l2_vs_bf16_4_steps": float(np.mean([rel_l2(g, r) for g, r in zip(got, refs["baseline"],
                                                                                    strict=True)])),
                "bf16_other_seed_rel_l2": quality["bf16_other_seed_rel_l2"],
                "requests": QUALITY_REQUESTS,
            }
        (out_dir / f"{args.model}-s{spec.steps}-{row}.json").write_text(json.dumps(result, indent=2) + "\n")
        print_row(result)
        if "quality" in result:
            print(f"    chunk rel-L2 vs bf16: same config {result['quality']['rel_l2_vs_bf16_same_config']:.4f}, "
                  f"vs 4-step bf16 {result['quality']['rel_l2_vs_bf16_4_steps']:.4f} "
                  f"(another seed: {quality['bf16_other_seed_rel_l2']:.4f})", flush=True)
        results.append(result)
        del engine
        release(dev)

    # Rows without quantization first, on the model as it is; then the model is swapped to gen-fp8 in place.
    for row, spec in specs.items():
        if spec.recipe == "bf16":
            measure(row, spec)
    if all(spec.recipe == "bf16" for spec in specs.values()):
        return _finish(results, args, env, command, quality, "bf16", out_dir)
    swapped = quantize_model(policy.model, "gen-fp8")
    print(f"gen-fp8: {len(swapped)} linears swapped", flush=True)
    if args.quality:
        # The SQNR table hooks each quantized module's forward: the unfused path calls them (engine/fp8_fusion.py
        # calls their GEMMs on inputs it quantized itself).
        sq_engine = Engine.from_policy(policy, engine_config(dev, attention=attention, compile=False, cuda_graph=False,
                                                             fp8_quantize="inductor"))
        table = layer_sqnr(reference, policy.model,
                           lambda m: sq_engine.infer(sample_observation(500), seed=1000, steps=4))
        del sq_engine, reference
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        measured = [r for r in table if r.calls]
        if not measured:
            raise RuntimeError("SQNR: no quantized linear's forward ran (is the engine calling the GEMMs directly?)")
        values = np.array([r.sqnr_db for r in measured])
        quality["sqnr"] = {
            "bar_db": SQNR_BAR_DB, "layers": len(table), "measured": len(measured),
            "unexercised": [r.name for r in unexercised(table)],
            "failing": [r.name for r in failing(table)],
            "min_db": float(values.min()), "median_db": float(np.median(values)), "max_db": float(values.max()),
            "per_layer_db": {r.name: round(r.sqnr_db, 3) for r in measured},
            "activations": "one full DROID request (tier 480, 4 steps, CFG), random weights",
        }
        print(f"per-layer SQNR: min {values.min():.2f} / median {np.median(values):.2f} dB over {len(measured)} "
              f"linears, {len(quality['sqnr']['failing'])} under {SQNR_BAR_DB} dB", flush=True)
    for row, spec in specs.items():
        if spec.recipe != "bf16":
            measure(row, spec)
    return _finish(results, args, env, command, quality, "gen-fp8", out_dir)


def _finish(results: list[dict], args: argparse.Namespace, env: dict, command: str, quality: dict, recipe: str,
            out_dir: Path) -> list[dict]:
    """The lossy waterfall chart (after the exact E5 row, where this run measured one) and the quality record of
    the weights the rows ran (`recipe`: gen-fp8 once any row quantized them)."""
    exact = out_dir / f"{args.model}-s4-E5.json"
    chart = ([json.loads(exact.read_text())] if exact.exists() else []) + results
    try:
        plot_waterfall(chart, out_dir / f"waterfall-{args.model}-lossy.png",
                       f"Cosmos 3 {args.model}: exact E5 then lossy rows (random weights, tier 480, {env.get('gpu')})")
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
    if args.quality:
        record = {"kind": "quality", "command": command, **env, "model": args.model, "recipe": recipe,
                  "weights": "random", "tier": 480, **quality,
                  "rows": {r["row"]: r.get("quality") for r in results}}
        (out_dir / f"{args.model}-quality-{recipe}.json").write_text(json.dumps(record, indent=2) + "\n")
    return results
