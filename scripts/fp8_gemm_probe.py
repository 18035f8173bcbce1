"""Issue 14 moonshot probe: the gen-fp8 Generator GEMMs (e4m3, rowwise scales, bf16 out) on cuBLAS
(`torch._scaled_mm`, what `Fp8Linear` runs) against a Triton TMA kernel at a few tile shapes, for every Generator GEMM
of Edge and Nano at a tier-480 request's token count (both CFG rows). fp8_mlp_epilogue_probe.py found the Triton kernel
faster than cuBLAS at Edge's up-projection; this asks whether that holds for the other shapes, which decides whether
epilogue fusions on a Triton GEMM (q/k/v heads, the MLP activation) start from a par GEMM. Timed in a CUDA graph;
writes `fp8-gemm-probe.json` under --out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from probe_cli import probe_parser, probe_start  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_mlp_epilogue_probe import cublas_rowwise, triton_up  # noqa: E402

from wamrt.ops.attention import _graph_ms  # noqa: E402
from wamrt.quant.fp8 import quantize_rowwise_fp8  # noqa: E402

SHAPES = {  # name -> (N, K) of y[M, N] = x[M, K] @ W[N, K]^T
    "edge": {"qkv": (4096, 2048), "out": (2048, 2048), "up": (9216, 2048), "down": (2048, 9216)},
    "nano": {"qkv": (6144, 4096), "out": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, warps=w, stages=s)
           for bm, bn, bk, g, w, s in ((128, 256, 128, 8, 8, 3), (128, 256, 128, 8, 8, 4), (128, 256, 64, 8, 8, 4),
                                       (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4), (256, 128, 128, 8, 8, 3),
                                       (128, 256, 128, 16, 8, 3), (64, 256, 128, 8, 4, 4))]


def main() -> None:
    ap = probe_parser()
    ap.add_argument("--models", default="edge,nano")
    args, out_dir = probe_start(ap)
    m = args.tokens
    result: dict = {"tokens": m, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": []}
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
            xq, xs = quantize_rowwise_fp8(x)
            wq, ws = quantize_rowwise_fp8(w)
            ws = ws.squeeze(-1).contiguous()
            want = cublas_rowwise(xq, xs, wq, ws)
            row = {"model": model, "gemm": name, "N": n, "K": k,
                   "cublas_ms": _graph_ms(lambda: cublas_rowwise(xq, xs, wq, ws), args.iters),
                   "cublas_fast_accum_ms": _graph_ms(lambda: torch._scaled_mm(
                       xq, wq.t(), scale_a=xs, scale_b=ws[None, :], out_dtype=torch.bfloat16, use_fast_accum=True),
                       args.iters), "triton": []}
            for cfg in CONFIGS:
                entry = dict(cfg)
                try:
                    got = triton_up(xq, xs, wq, ws, 0, cfg)[0]
                    entry["max_abs_diff_vs_cublas"] = (got.float() - want.float()).abs().max().item()
                    entry["ms"] = _graph_ms(lambda cfg=cfg: triton_up(xq, xs, wq, ws, 0, cfg), args.iters)
                except Exception as e:  # a tile shape this build or this GEMM refuses (shared memory, N % tile)
                    entry["error"] = repr(e)[:300]
                row["triton"].append(entry)
            timed = [e for e in row["triton"] if "ms" in e]
            best = min(timed, key=lambda e: e["ms"]) if timed else None
            row["best_triton"] = best
            row["tflops_cublas"] = 2 * m * n * k / row["cublas_ms"] / 1e9
            print(model, name, f"cuBLAS {row['cublas_ms']:.4f} ms, fast accumulation {row['cublas_fast_accum_ms']:.4f}",
                  "best Triton",
                  None if best is None else (round(best["ms"], 4), {c: best[c] for c in CONFIGS[0]}), flush=True)
            result["rows"].append(row)
    (out_dir / "fp8-gemm-probe.json").write_text(json.dumps(result, indent=1))
    print("wrote", out_dir / "fp8-gemm-probe.json")


if __name__ == "__main__":
    main()
