"""Issue 14 moonshot: 8-bit attention candidates at the Generator call's shapes, timed as the engine runs them (calls
captured in a CUDA graph) beside flash-attn-4 bf16: the Triton int8-QK / e4m3-PV kernel (wamrt.ops.quantized_attention)
in several tile configs and memory layouts, its TMA variant (scripts/tma_attention_variant.py, --tma-configs),
flash-attn-4 at other SM90 tiles (--fa4-sweep), cuDNN's fp8 SDPA where scripts/cudnn_fp8_probe.py can build it, and
FlashAttention-3's bf16 and e4m3 forwards where fa3-fwd is installed (scripts/fa3_probe.py),
with the SQNR of each against fp32 attention on the bf16 inputs.

    python3 scripts/fp8_attention_probe.py --out DIR [--models edge,nano]

Inputs: q and k rows RMS-normalised per head (the model's QK norm) times a norm weight `w` (1: logits ~ N(0, 1), a
flat softmax; 2: logits ~ N(0, 16), a peaked one), v Gaussian with a few 10x channels; keys [Generator 3092 |
prefix 125 or 30 | padding], the engine's batched-CFG rows (flash-attn-4's seqused_k).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from wamrt.ops.attention import _graph_ms, fa4_attention, fa4_available, sdpa  # noqa: E402
from wamrt.ops.quantized_attention import (  # noqa: E402
    FP8_MAX,
    QuantizedKeyLengthAttention,
    exact_key_length_attention,
    quantize_fp8,
    quantize_fp8_tensor_cuda,
    quantize_rowwise_int8_cuda,
    quantized_attention,
    quantized_attention_reference,
)
from wamrt.quant.int8 import quantize_rowwise_int8  # noqa: E402
from wamrt.quant.sqnr import sqnr_db  # noqa: E402

SHAPES = {"edge": (16, 8), "nano": (32, 8)}  # query heads, K/V heads
G, PREFIX, USED = 3092, 125, (3092 + 125, 3092 + 30)
# flash-attn-4's SM90 forward: (tile_m, tile_n, PV MMA from registers, intra-warpgroup overlap, pack_gqa); the first
# is what 4.0.0b36 picks for head_dim 128 (interface._tile_size_fwd_sm90), the others FA3's C++ choices and neighbours.
FA4_SWEEP = [(128, 128, True, True, True), (128, 176, True, True, True), (128, 192, True, True, True),
             (128, 160, True, True, True), (128, 176, False, True, True), (192, 128, False, True, True),
             (128, 128, True, True, False)]
TMA_CONFIGS = [  # block_m, block_n, num_warps, num_stages (scripts/tma_attention_variant.py)
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3),
]
CONFIGS = [  # block_m, block_n, num_warps, num_stages
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2), (64, 128, 4, 3),
    (128, 64, 8, 4),
]


def inputs(heads: int, kv_heads: int, w: float, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    d, length = 128, G + PREFIX

    def normed(*shape):
        x = torch.randn(*shape, device=device, generator=gen)
        return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)

    q = normed(2, G, heads, d).transpose(1, 2)  # [B, H, G, d] view of [B, G, H, d], as the engine's q
    k = normed(2, kv_heads, length, d)
    v = torch.randn(2, kv_heads, length, d, device=device, generator=gen)
    v[..., :4] *= 10
    v = v.to(torch.bfloat16)
    used = torch.tensor(USED, device=device, dtype=torch.int32)
    for t in (k, v):  # keys past `used` hold finite junk, as the engine's padding may
        t[1, :, USED[1]:] = 3.0
    return q, k, v, used


def tma_rows(q8, qs, k8, ks, v8, dv, used, ref, qref, iters, configs) -> list[dict]:
    """The experimental TMA variant (scripts/tma_attention_variant.py) per tile config."""
    out = []
    try:
        from tma_attention_variant import tma_attention, vt_padded  # beside this script

        vt16 = vt_padded(v8)
    except Exception as e:  # an older Triton without host tensor descriptors
        return [{"error": repr(e)[:300]}]
    vd = torch.full((1,), dv, device=q8.device, dtype=torch.float32)
    for bm, bn, warps, stages in configs:
        kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        entry = {"config": [bm, bn, warps, stages]}
        try:
            got = tma_attention(q8, qs, k8, ks, vt16, vd, used, **kw)
            entry.update(ms=_graph_ms(lambda kw=kw: tma_attention(q8, qs, k8, ks, vt16, vd, used, **kw), iters),
                         sqnr_db=sqnr_db(ref, got), vs_reference_db=sqnr_db(qref, got))
        except Exception as e:  # a config the compiler refuses
            entry["error"] = repr(e)[:300]
        print("tma", entry, flush=True)
        out.append(entry)
    return out


def fa4_sweep(q, k, v, used, ref, iters, configs) -> list[dict]:
    """flash-attn-4's forward at other SM90 tile configurations than its default (private `_flash_attn_fwd`, the
    only entry that takes them)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = []
    for tm, tn, rs, overlap, pack in configs:
        kw = dict(seqused_k=used, tile_mn=(tm, tn), mma_pv_is_rs=rs, intra_wg_overlap=overlap, pack_gqa=pack)
        entry = {"tile_mn": [tm, tn], "mma_pv_is_rs": rs, "intra_wg_overlap": overlap, "pack_gqa": pack}
        try:
            t0 = time.perf_counter()
            got = _flash_attn_fwd(qt, kt, vt, **kw)[0].transpose(1, 2)
            entry["first_call_s"] = time.perf_counter() - t0  # the CuTe DSL compile
            entry["sqnr_db"] = sqnr_db(ref, got)
            entry["ms"] = _graph_ms(lambda kw=kw: _flash_attn_fwd(qt, kt, vt, **kw), iters)
        except Exception as e:  # a tile the kernel refuses
            entry["error"] = repr(e)[:300]
        print("fa4 sweep", entry, flush=True)
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="edge,nano")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fa4-sweep", type=int, default=0, help="how many of FA4_SWEEP to time (0: none)")
    ap.add_argument("--tma-configs", type=int, default=0, help="how many of TMA_CONFIGS to time (0: none)")
    ap.add_argument("--triton-configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to time (0: none)")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for model in args.models.split(","):
        heads, kv_heads = SHAPES[model]
        flop = sum(4 * heads * G * n * 128 for n in USED)
        for w in (1.0, 2.0):
            q, k, v, used = inputs(heads, kv_heads, w, device)
            ref = exact_key_length_attention(q, k, v, USED)
            dv = float(v.abs().amax()) / FP8_MAX
            q8, qs = quantize_rowwise_int8(q)  # [B, H, G, d] contiguous
            q8v, qsv = quantize_rowwise_int8(q.transpose(1, 2))  # the engine's: a view of [B, G, H, d] memory
            q8v, qsv = q8v.transpose(1, 2), qsv.transpose(1, 2)
            k8, ks = quantize_rowwise_int8(k)
            v8 = quantize_fp8(v, dv)
            v8t = v8.transpose(-1, -2).contiguous().transpose(-1, -2)  # V^T memory
            row = {"model": model, "w": w, "tflop_per_call": flop / 1e12}
            if fa4_available(device):
                fa4 = fa4_attention(q, k, v, seqused_k=used)
                row["fa4_bf16"] = {"ms": _graph_ms(lambda: fa4_attention(q, k, v, seqused_k=used), args.iters),
                                   "sqnr_db": sqnr_db(ref, fa4)}
            if fa4_available(device) and args.fa4_sweep and w == 1.0:
                row["fa4_sweep"] = fa4_sweep(q, k, v, used, ref, args.iters, FA4_SWEEP[: args.fa4_sweep])
            ke, ve = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            row["cudnn_bf16_unmasked"] = {"ms": _graph_ms(lambda: sdpa(q, ke, ve, causal=False, backend="cudnn"),
                                                          args.iters)}
            qref = quantized_attention_reference(q8, qs, k8, ks, v8, dv, used)
            row["quantized_reference_sqnr_db"] = sqnr_db(ref, qref)
            row["triton_int8_fp8"] = []
            for bm, bn, warps, stages in CONFIGS[: args.triton_configs]:
                kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                entry = {"config": [bm, bn, warps, stages]}
                for name, args_ in (("v_t", (q8v, qsv, k8, ks, v8t)), ("v_rows", (q8v, qsv, k8, ks, v8)),
                                    ("q_contiguous", (q8, qs, k8, ks, v8t))):
                    try:
                        got = quantized_attention(*args_, dv, used, **kw)
                        entry[name] = {"ms": _graph_ms(lambda: quantized_attention(*args_, dv, used, **kw), args.iters),
                                       "sqnr_db": sqnr_db(ref, got), "vs_reference_db": sqnr_db(qref, got)}
                    except Exception as e:  # a config the compiler refuses (shared memory, registers)
                        entry[name] = {"error": repr(e)[:300]}
                row["triton_int8_fp8"].append(entry)
                print(model, w, entry, flush=True)
            if args.tma_configs:
                row["tma_int8_fp8"] = tma_rows(q8v, qsv, k8, ks, v8, dv, used, ref, qref, args.iters,
                                               TMA_CONFIGS[: args.tma_configs])
            op = QuantizedKeyLengthAttention(USED, device)
            try:
                got = op(q, k, v, causal=False)
                row["op_with_quantizers"] = {"ms": _graph_ms(lambda: op(q, k, v, causal=False), args.iters),
                                             "sqnr_db": sqnr_db(ref, got)}
                row["quantizers_ms"] = {
                    "q_rows_int8": _graph_ms(lambda: quantize_rowwise_int8_cuda(q), args.iters),
                    "k_rows_int8": _graph_ms(lambda: quantize_rowwise_int8_cuda(k), args.iters),
                    "v_fp8": _graph_ms(lambda: quantize_fp8_tensor_cuda(v), args.iters)}
            except Exception as e:
                row["op_with_quantizers"] = {"error": repr(e)[:600]}
            print(model, w, "op", row["op_with_quantizers"], row.get("quantizers_ms"), flush=True)
            try:
                from cudnn_fp8_probe import cudnn_fp8_rows  # optional, beside this script
                row["cudnn_fp8"] = cudnn_fp8_rows(q, k, v, used, ref, dv, args.iters, sqnr_db)
            except ImportError as e:
                row["cudnn_fp8"] = {"error": repr(e)[:300]}
            except Exception as e:
                row["cudnn_fp8"] = {"error": repr(e)[:600]}
            try:
                from fa3_probe import fa3_rows  # beside this script; needs fa3-fwd (gpu_run.sh: .whl-fa3)

                row["fa3"] = fa3_rows(q, k, v, used, ref, args.iters, sqnr_db, _graph_ms)
            except ImportError as e:
                row["fa3"] = {"error": repr(e)[:300]}
            for key in ("fa4_bf16", "cudnn_bf16_unmasked", "cudnn_fp8", "quantized_reference_sqnr_db"):
                print(model, w, key, row.get(key), flush=True)
            rows.append(row)
    sha = os.environ.get("WAMRT_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    result = {"kind": "attention-probe", "command": " ".join(sys.argv), "git_sha": sha,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "triton": __import__("triton").__version__, "shapes": {"G": G, "prefix": PREFIX, "used": USED},
              "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8-attention-probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
