"""`wamrt bench decode`: the Reasoner's text decode at a real size on random weights.

Rows (`kind: latency`, `mode: decode`): prefill tokens/s; decode tokens/s at batch 1 (CUDA-graph steps, and eager
steps for comparison) and at the larger batches, each against the HBM floor of a step (the Reasoner's weight bytes,
its layers' Reasoner halves + final norm + lm_head, read once per step at the card's datasheet bandwidth, 4.8 TB/s on
the H200 the issue names; the K/V cache and the embedding row are left out, so the floor is a little optimistic;
each row also gives its fraction of the bandwidth a device-to-device copy reaches in the same process, which no
kernel can beat by much); and transformers' `generate` on the same weights in the same
process (`Qwen3VLForConditionalGeneration` via the issue's key mapping) as the baseline, with how many greedy tokens
of the two agree. A decode row's time per token is the median step (warm-up pass excluded: it captures the graphs)
with a bootstrap CI; a batch-B step makes B tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ..provenance import environment, utc_now
from .stats import device_ms, summarize

# Datasheet memory bandwidth by the name torch reports, most specific first. An H100 measured against the H200's
# 4.8 TB/s read 0.38 of a floor it cannot reach (bench/results/decode/2026-12-05-36131c6-nano-h100/).
DATASHEET_BYTES_PER_S = (
    ("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
    ("RTX PRO 6000", 1.792e12), ("RTX 4090", 1.008e12), ("RTX 5090", 1.792e12),
)
ASSUMED_BYTES_PER_S = 4.8e12  # a card not in the table: the H200's figure, and the result says it was assumed


def datasheet_bandwidth(gpu: str) -> tuple[float, str]:
    """(bytes/s, source) of a card's memory by its name: the datasheet figure, or the H200's where unknown."""
    for key, bytes_per_s in DATASHEET_BYTES_PER_S:
        if key.lower() in gpu.lower():
            return bytes_per_s, f"datasheet ({key})"
    return ASSUMED_BYTES_PER_S, "assumed: the H200's 4.8 TB/s (this card is not in the table)"


def copy_bandwidth(device: torch.device, gib: float = 1.0, reps: int = 10) -> float | None:
    """Bytes/s a device-to-device copy moves (read + written), median of `reps`: the practical ceiling of a
    memory-bound step on this card (the H100 here copies ~3.0 TB/s of its 3.35, the H200 ~4.3 of 4.8)."""
    if device.type != "cuda":
        return None
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = float(np.median(device_ms(lambda: dst.copy_(src), reps, device)))  # the 2 GiB are freed on return
    return 2 * gib * 2**30 / (ms / 1e3)


def reasoner_weight_bytes(model: torch.nn.Module, head: torch.nn.Module) -> int:
    """Bytes a decode step must read: every layer's Reasoner half, the Reasoner final norm, lm_head."""
    total = sum(p.numel() * p.element_size() for p in head.parameters())
    total += sum(p.numel() * p.element_size() for p in model.norm.parameters())
    for layer in model.layers:
        attn = layer.self_attn
        projections = [getattr(attn, n, None) for n in ("to_q", "to_k", "to_v", "qkv_proj")]  # fused or not
        for mod in (*[m for m in projections if m is not None], attn.to_out, attn.norm_q, attn.norm_k, layer.mlp,
                    layer.input_layernorm, layer.post_attention_layernorm):
            total += sum(p.numel() * p.element_size() for p in mod.parameters())
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# q/k/v (25 M weights at Nano) and o (17 M) below, gate/up (101 M), down (50 M) and lm_head (622 M) above
GEMV_LARGE_NUMEL = 40_000_000


def _decode_row(reasoner, prompt, batch: int, new: int, graphs: bool, floor_ms: float, fused: bool = False,
                copy_floor_ms: float | None = None, fused_weights: bool = False, fused_mode: str | None = None,
                lookahead: bool = False, attention: str = "sdpa", gemv: str = "cublas", one_row: bool = False,
                attention_prep: bool = True, merge_in_split: bool = False, pdl: bool = False) -> dict:
    from ..reasoner.engine import DecodeBatch
    from ..reasoner.sampling import SamplingParams

    dev = reasoner.lm.device
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    # merge_in_split and pdl off unless asked: the rows before them were measured without (DecodeBatch's defaults)
    db = DecodeBatch(reasoner, batch, cuda_graphs=graphs, fused=fused, fused_mode=fused_mode, lookahead=lookahead,
                     decode_attention=attention, one_row=one_row, attention_prep=attention_prep,
                     merge_in_split=merge_in_split, pdl=pdl)
    steps_ms: list[float] = []
    first_pass_ms: list[float] = []
    tokens: list[int] = []
    for timed in (False, True):  # the first pass captures the graphs its spans need (and compiles, fused)
        seqs = [db.admit(prompt, params).seq for _ in range(batch)]
        _sync(dev)
        t_prev = time.perf_counter()
        while db.live:
            # A step ends in the host read of sampled tokens: this step's, or with lookahead the previous one's while
            # this one runs. So the time between two returns is the step period either way; a sync before each step
            # would time only a lookahead step's launch (dfeffd6's rows: 0.24-0.33 ms "steps").
            db.step()
            now = time.perf_counter()
            (steps_ms if timed else first_pass_ms).append(1e3 * (now - t_prev))
            t_prev = now
        _sync(dev)
        tokens = seqs[0].tokens
    stats = summarize(steps_ms)
    # a failed compile leaves the graphs on the eager layers (logged): not a fused row then
    fused = fused and (db.graphs is None or db.graphs.layer_fn is not None)
    return {"kind": "latency", "mode": "decode", "batch": batch, "cuda_graph": graphs, "fused": fused,
            "fused_weights": fused_weights, "fused_mode": (fused_mode or "default") if fused else None,
            "lookahead": lookahead, "attention": attention, "gemv": gemv, "one_row": one_row,
            "attention_prep": one_row and attention_prep,
            "merge_in_split": merge_in_split and attention == "split", "pdl": pdl and one_row,
            "tokens_per_s": batch * 1e3 / stats["p50_ms"], "step": stats,
            "floor_fraction": floor_ms / stats["p50_ms"], "tokens": tokens,
            "copy_floor_fraction": None if copy_floor_ms is None else copy_floor_ms / stats["p50_ms"],
            # The first pass's slowest step: with graphs, the one that captured its bucket (and compiled, fused).
            # A chat server captures each (rows, span) bucket on first use, in one device segment of this length.
            "first_use_step_ms": max(first_pass_ms)}


# The batch-1 rows on the Triton GEMVs, in this order (the fold changes the model: the folded rows come last).
# "all" / "large": `ops.gemv.GemvLinear` on every matrix / on gate/up, down and lm_head only (q/k/v and o stay the
# compiler's). "one-row": every matrix on the GEMV and the layer's norms, residual adds and SiLU * up inside the GEMVs
# (reasoner/fused.py `OneRowDecode`, ops/gemv_fused.py), the q/k norms and RoPE inside the attention kernel
# ("-noprep": compiled between); "one-row-folded": the norms' weights folded into the matrices (engine/fuse.py
# fold_reasoner_norms); "+merge": the attention's splits merged by its last program; "+pdl": the stack's kernels
# launched with programmatic dependent launch; "+preloadN": each GEMV reads N weight slices before it waits, not one.
GEMV_ROWS = ("all", "large", "one-row-noprep", "one-row", "one-row-folded", "one-row-folded+merge",
             "one-row-folded+pdl", "one-row-folded+merge+pdl", "one-row-folded+pdl+preload2",
             "one-row-folded+merge+pdl+preload2", "one-row-folded+pdl+preload4", "one-row-folded+merge+pdl+preload4")


def setup_gemv_row(lm, label: str) -> dict:
    """Puts `lm` (its Reasoner matrices fused, `engine.fuse.fuse_reasoner`) in the state a `GEMV_ROWS` label
    measures; returns the row's `DecodeBatch` options. The one-row stack calls its kernels on plain nn.Linear
    matrices: 5e3177d's call left the `GemvLinear` swap of the rows before on them, and every one-row row failed."""
    from ..engine.fuse import fold_reasoner_norms
    from ..ops import gemv_fused
    from ..ops.gemv import undo_gemv_kernel, use_gemv_kernel

    one_row = label.startswith("one-row")
    if label.startswith("one-row-folded"):
        fold_reasoner_norms(lm.transformer, lm.lm_head)  # once: a folded model folds nothing more
    undo_gemv_kernel(lm)
    if not one_row:
        use_gemv_kernel(lm, GEMV_LARGE_NUMEL if label == "large" else 0)
    torch._dynamo.reset()  # compiled layers keep the kernels they were compiled with (dfeffd6)
    gemv_fused.PDL_PRELOAD_SLICES = _preload_slices(label)
    return {"one_row": one_row, "attention_prep": not label.endswith("noprep"), "merge_in_split": "+merge" in label,
            "pdl": "+pdl" in label}


def _preload_slices(label: str) -> int:
    """`ops.gemv_fused.PDL_PRELOAD_SLICES` for a gemv row label: N for "+preloadN", else 1 (not the default)."""
    _, found, n = label.partition("+preload")
    return int(n) if found else 1


def _agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _hf_baseline(model, head, ids: torch.Tensor, new: int) -> dict:
    """transformers' Qwen3-VL on the same weights: ms per token = (generate(new) - generate(1)) / (new - 1)."""
    from transformers import Qwen3VLForConditionalGeneration

    from ..reasoner.keys import qwen3vl_config, qwen3vl_state_dict

    cfg = model.config
    vision = {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
              "out_hidden_size": cfg.hidden_size, "deepstack_visual_indexes": [0]}
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    with torch.device(dev):
        hf = Qwen3VLForConditionalGeneration(qwen3vl_config(cfg, head.weight.shape[0], vision))
    hf = hf.to(dtype).eval().requires_grad_(False)
    state = qwen3vl_state_dict(model.state_dict(), head.weight)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    mask = torch.ones_like(ids)

    def gen(n: int) -> tuple[float, torch.Tensor]:
        _sync(dev)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(dev)
        return 1e3 * (time.perf_counter() - t0), out[0, ids.shape[1]:]

    gen(4)  # warm-up
    one = min(gen(1)[0] for _ in range(2))
    runs = [gen(new) for _ in range(2)]
    full = min(r[0] for r in runs)
    per_token = (full - one) / (new - 1)
    return {"ms_per_token": per_token, "tokens_per_s": 1e3 / per_token, "generate_ms": full, "prefill_ms": one,
            "tokens": runs[0][1].tolist()}


def run(args: argparse.Namespace) -> int:
    from ..ops import gemv_fused
    from ..pipeline.random_weights import random_transformer
    from ..reasoner.engine import Reasoner
    from ..reasoner.lm import KVCache, ReasonerLM
    from ..reasoner.load import random_lm_head
    from ..reasoner.prompt import PreparedPrompt

    size = "tiny-qwen" if args.tiny else args.size
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 48), min(args.new_tokens, 16)
        args.hf_tokens, args.prefill_reps = min(args.hf_tokens, 8), min(args.prefill_reps, 2)
    t_build = time.perf_counter()
    model = random_transformer(size, device, dtype)
    head = random_lm_head(model, seed=1)
    lm = ReasonerLM(model, head)
    reasoner = Reasoner(lm, None, max_len=args.prompt_tokens + args.new_tokens + 8)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.weight.shape[0], (args.prompt_tokens,), generator=gen).tolist()
    positions = torch.arange(len(ids), dtype=torch.float32).expand(3, -1)
    prompt = PreparedPrompt(ids, positions, len(ids), [], None)
    build_s = time.perf_counter() - t_build
    weight_bytes = reasoner_weight_bytes(model, head)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bytes_per_s, bandwidth_source = datasheet_bandwidth(gpu)
    floor_ms = 1e3 * weight_bytes / bytes_per_s
    copy_bytes_per_s = copy_bandwidth(device)
    copy_floor_ms = None if copy_bytes_per_s is None else 1e3 * weight_bytes / copy_bytes_per_s
    graphs = device.type == "cuda"

    with torch.no_grad():
        cache = KVCache.empty(model, 1, len(ids) + 1)
        embeds = lm.embed(torch.tensor([ids], device=device))
        pos = positions[None].to(device)
        prefill_ms = []
        for i in range(args.prefill_reps + 1):
            _sync(device)
            t0 = time.perf_counter()
            lm.run_prompt(embeds, pos, cache=cache)
            _sync(device)
            if i:
                prefill_ms.append(1e3 * (time.perf_counter() - t0))
        del cache
        pre = summarize(prefill_ms)
        floors = {"floor_ms": floor_ms, "copy_floor_ms": copy_floor_ms}
        failed: list[dict] = []  # rows whose configuration raised (a kernel that did not build), with the error
        rows = [_decode_row(reasoner, prompt, 1, min(args.new_tokens, 32), False, **floors)] if graphs else []
        rows += [_decode_row(reasoner, prompt, b, args.new_tokens, graphs, **floors) for b in args.batches]
        if graphs and args.fused:
            rows += [_decode_row(reasoner, prompt, b, args.new_tokens, graphs, fused=True, **floors)
                     for b in args.batches]
        hf = _hf_baseline(model, head, torch.tensor([ids], device=device), args.hf_tokens) if args.hf_tokens > 1 \
            else None
        if graphs:  # the one-row stack on the model's own separate matrices, nothing compiled: the chat server's
            try:
                rows.append(_decode_row(reasoner, prompt, 1, args.new_tokens, graphs, lookahead=True,
                                        attention="split", gemv="triton:one-row-separate+pdl+preload"
                                        f"{gemv_fused.PDL_PRELOAD_SLICES}", one_row=True, pdl=True, **floors))
            except Exception as e:  # noqa: BLE001  a kernel that fails to build costs its row only
                failed.append({"batch": 1, "gemv": "one-row-separate", "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(f"decode row batch 1 one-row-separate failed: {failed[-1]['error']}")
        if args.fuse_weights:  # last: it changes the model (one matrix for q/k/v and one for gate/up, every layer)
            from ..engine.fuse import fuse_reasoner

            fuse_reasoner(model)
            rows += [_decode_row(reasoner, prompt, b, args.new_tokens, graphs, fused=graphs, fused_weights=True,
                                 **floors) for b in args.batches]
            for mode in args.fused_modes if graphs else []:  # batch 1, the bar, in the other compile modes
                rows.append(_decode_row(reasoner, prompt, 1, args.new_tokens, graphs, fused=True, fused_weights=True,
                                        fused_mode=mode, **floors))
            # the next step launched before this one's tokens are read (DecodeBatch(lookahead=True)), then also the
            # split-key attention kernel (ops/decode_attention.py), in the default compile mode and in the last of
            # --fused-modes
            for mode in dict.fromkeys([None, *args.fused_modes[-1:]]):
                for attention in ("sdpa", "split"):
                    for b in args.batches[:2]:
                        try:
                            rows.append(_decode_row(reasoner, prompt, b, args.new_tokens, graphs, fused=graphs,
                                                    fused_weights=True, fused_mode=mode, lookahead=True,
                                                    attention=attention, **floors))
                        except Exception as e:  # noqa: BLE001  a kernel that fails to build costs its rows only
                            failed.append({"batch": b, "fused_mode": mode, "attention": attention,
                                           "error": f"{type(e).__name__}: {str(e)[:500]}"})
                            print(f"decode row batch {b} {attention} failed: {failed[-1]['error']}")
        profile = None
        # the best configurations (fused weights where applied), kernel by kernel; not after a kernel failed to build
        if graphs and args.profile_steps and not failed:
            from .decode_profile import describe, profile_decode

            profile = {"fused_weights": args.fuse_weights,
                       **{key: profile_decode(reasoner, prompt, steps=args.profile_steps, lookahead=ahead,
                                              attention=attention)
                          for key, ahead, attention in (("plain", False, "sdpa"), ("lookahead", True, "sdpa"),
                                                        ("lookahead+split", True, "split"))}}
        if graphs and args.fuse_weights:
            # last: the batch-1 projections on the Triton GEMV (ops/gemv.py) instead of what the compiler picks, with
            # lookahead and the split kernel, in the default compile mode and the last of --fused-modes: on every
            # matrix, then on the large ones only (gate/up, down, lm_head; q/k/v and o stay the compiler's)
            from ..ops.gemv import undo_gemv_kernel

            last_mode = args.fused_modes[-1] if args.fused_modes else None
            if profile is not None and last_mode is not None:  # where that mode's time goes, before any GEMV swap
                profile[f"lookahead+split ({last_mode})"] = profile_decode(
                    reasoner, prompt, steps=args.profile_steps, fused_mode=last_mode, lookahead=True, attention="split")
            best: tuple[float, str, int] | None = None
            default_preload = gemv_fused.PDL_PRELOAD_SLICES
            for label in GEMV_ROWS:
                options = setup_gemv_row(lm, label)
                one_row = options["one_row"]
                for mode in [None] if one_row else dict.fromkeys([None, last_mode]):
                    try:
                        row = _decode_row(reasoner, prompt, 1, args.new_tokens, graphs, fused=True,
                                          fused_weights=True, fused_mode=mode, lookahead=True, attention="split",
                                          gemv=f"triton:{label}", **options, **floors)
                    except Exception as e:  # noqa: BLE001  a kernel that fails to build costs its rows only
                        failed.append({"batch": 1, "fused_mode": mode, "attention": "split", "gemv": label,
                                       "error": f"{type(e).__name__}: {str(e)[:500]}"})
                        print(f"decode row batch 1 gemv {label} failed: {failed[-1]['error']}")
                        continue
                    rows.append(row)
                    if best is None or row["step"]["p50_ms"] < best[0]:
                        best = (row["step"]["p50_ms"], label, mode)
            if profile is not None and best is not None:
                _, label, mode = best
                if label in ("one-row", "one-row-noprep"):  # the norms are folded by now: what the profile runs
                    label = label.replace("one-row", "one-row-folded")
                profile[f"lookahead+split+gemv:{label} ({mode or 'default'})"] = profile_decode(
                    reasoner, prompt, steps=args.profile_steps, fused_mode=mode, lookahead=True, attention="split",
                    **setup_gemv_row(lm, label))
            undo_gemv_kernel(lm)
            gemv_fused.PDL_PRELOAD_SLICES = default_preload
    gemvs = None
    if graphs:  # last: the step's matrices read by the GEMV kernel alone (bench/decode_gemvs.py)
        from .decode_gemvs import gemvs_alone

        try:
            gemvs = gemvs_alone(lm)
        except Exception as e:  # noqa: BLE001  a diagnostic: its failure costs only itself
            gemvs = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    ours1 = next(r for r in rows if r["batch"] == 1 and r["cuda_graph"] == graphs and not r["fused"]
                 and not r["fused_weights"] and not r["lookahead"])
    if graphs:  # the graph replays compute what the eager steps do
        eager = rows[0]["tokens"]
        ours1["greedy_tokens_equal_eager"] = ours1["tokens"][:len(eager)] == eager
    for r in rows:  # fused kernels and matrices round differently: how far greedy decoding goes before it parts
        if (r["fused"] or r["fused_weights"] or r["one_row"]) and r["batch"] == 1:
            r["greedy_tokens_agreeing_unfused"] = _agreeing(r["tokens"], ours1["tokens"])
    best1 = max((r for r in rows if r["batch"] == 1), key=lambda r: r["tokens_per_s"])
    if hf is not None:
        hf["greedy_tokens_agreeing"] = _agreeing(ours1["tokens"], hf["tokens"])
        hf["speedup_ours_batch1"] = ours1["tokens_per_s"] / hf["tokens_per_s"]  # the plain graph row
        hf["speedup_best_batch1"] = best1["tokens_per_s"] / hf["tokens_per_s"]
    for r in rows:
        del r["tokens"]
    if hf is not None:
        del hf["tokens"]
    result = {
        "kind": "latency", "mode": "decode", "model": size, "weights": "random", "dtype": str(dtype),
        "command": "wamrt bench decode " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                    if k in ("size", "prompt_tokens", "new_tokens", "hf_tokens")),
        **environment(), "build_s": build_s, "reasoner_weight_bytes": weight_bytes,
        "hbm_floor": {"bytes_per_s": bytes_per_s, "source": bandwidth_source, "step_ms": floor_ms,
                      "batch1_tokens_per_s": 1e3 / floor_ms},
        "copy_floor": None if copy_floor_ms is None else {"bytes_per_s": copy_bytes_per_s, "step_ms": copy_floor_ms},
        "prefill": {"kind": "latency", "mode": "prefill", "batch": 1, "prompt_tokens": len(ids),
                    "tokens_per_s": len(ids) * 1e3 / pre["p50_ms"], **pre},
        "rows": rows, "failed_rows": failed, "transformers_generate": hf, "profile": profile, "gemvs_alone": gemvs,
    }
    copy = "" if copy_floor_ms is None else f", {copy_floor_ms:.2f} ms at the copy's {copy_bytes_per_s / 1e12:.2f} TB/s"
    print(f"{size} Reasoner ({weight_bytes / 1e9:.2f} GB, floor {floor_ms:.2f} ms/step at "
          f"{bytes_per_s / 1e12:.2f} TB/s, {bandwidth_source}{copy}) on {result['gpu']}")
    print(f"prefill {len(ids)} tokens: {result['prefill']['tokens_per_s']:.0f} tokens/s ({pre['p50_ms']:.1f} ms)")
    for r in rows:
        kind = ("graph" if r["cuda_graph"] else "eager") + ("+fused" if r["fused"] else "") \
            + ("+qkv/gate-up" if r["fused_weights"] else "") \
            + (f" ({r['fused_mode']})" if r["fused_mode"] not in (None, "default") else "") \
            + (" +lookahead" if r["lookahead"] else "") + (" +split attention" if r["attention"] == "split" else "") \
            + (f" +{r['gemv'].replace(':', ' gemv on ')} matrices" if r["gemv"] != "cublas" else "")
        print(f"decode batch {r['batch']:>2} {kind}: {r['tokens_per_s']:8.1f} "
              f"tokens/s, step {r['step']['p50_ms']:.2f} ms (CI {r['step']['ci95_p50_ms'][0]:.2f}-"
              f"{r['step']['ci95_p50_ms'][1]:.2f}), floor fraction {r['floor_fraction']:.2f}"
              + ("" if r["copy_floor_fraction"] is None else f" (of the copy's: {r['copy_floor_fraction']:.2f})")
              + ", first use "
              f"{r['first_use_step_ms']:.0f} ms")
    if profile is not None:
        print("\n".join(f"[{k}] {describe(v)}" for k, v in profile.items() if k != "fused_weights"))
    if gemvs is not None:
        from .decode_gemvs import describe as describe_gemvs

        print(gemvs["error"] if "error" in gemvs else describe_gemvs(gemvs, best1["step"]["p50_ms"]))
    if hf is not None:
        print(f"transformers generate batch 1: {hf['tokens_per_s']:.1f} tokens/s ({hf['ms_per_token']:.2f} ms/token); "
              f"ours x{hf['speedup_ours_batch1']:.2f} (graph), x{hf['speedup_best_batch1']:.2f} (best row); "
              f"greedy tokens agreeing: {hf['greedy_tokens_agreeing']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{utc_now()[:10]}-{result['git_sha'][:7]}-decode-{size}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"out": str(path), "batch1_tokens_per_s": ours1["tokens_per_s"],
                      "batch1_floor_fraction": ours1["floor_fraction"], "best_batch1": best1["gemv"],
                      "best_batch1_tokens_per_s": best1["tokens_per_s"],
                      "best_batch1_floor_fraction": best1["floor_fraction"]}))
    return 0
