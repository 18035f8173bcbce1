"""Issue 14 moonshot probe: the gen-fp8 layer's per-row activation quantizers (`engine/fp8_fusion.py`) against the
memory floor of the same bytes.

The Edge E7 trace (bench/results/latency/2026-12-03-1ba1cea-fast-accum/) has `_act_quant_kernel` at 58 us per
ReLU^2 call (6,184 x 9,216 bf16 in, e4m3 out: ~171 MB, ~2.9 TB/s) and 9.9 us per attention-output call (~38 MB,
~3.8 TB/s). This times, in one CUDA graph per variant, at a tier-480 request's token count (both CFG rows):
* every config of the autotuned kernel, forced (which one autotuning picks is recorded too);
* a persistent variant (a grid of a few programs per SM looping over rows, Triton's software pipelining loading the
  next row while this one is reduced and stored) at a few grid sizes and pipeline depths;
* the floor: a bf16 -> e4m3 cast of the same tensor (the same bytes read and written, no reduction).
Every variant's output is checked against the reference (same bits). Writes `act-quant-probe.json` under --out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_cli import probe_parser, probe_start  # noqa: E402

from wamrt.engine import fp8_fusion  # noqa: E402
from wamrt.engine.fp8_fusion import ACTIVATIONS, _activation, fp8_act_quant  # noqa: E402
from wamrt.ops.attention import _graph_ms  # noqa: E402
from wamrt.quant.fp8 import FP8  # noqa: E402

CASES = {  # name -> (y width, activation)
    "edge-relu_sq": (9216, "relu_sq"), "edge-out": (2048, "none"),
    "nano-swiglu": (24576, "swiglu"), "nano-out": (4096, "none"),
}


@triton.jit
def _act_quant_persistent(y_ptr, q_ptr, scale_ptr, M, y_row_stride, N: tl.constexpr, ACT: tl.constexpr,
                          BLOCK: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        src = y_ptr + row.to(tl.int64) * y_row_stride
        a = _activation(src, cols, mask, N, ACT)
        scale = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(a / scale, -448.0), 448.0)
        tl.store(q_ptr + row.to(tl.int64) * N + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
        tl.store(scale_ptr + row, scale)


def main() -> None:
    args, out_dir = probe_start(probe_parser())
    m = args.tokens
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {"tokens": m, "torch": torch.__version__, "triton": triton.__version__,
                    "gpu": torch.cuda.get_device_name(), "cases": []}
    kernel = fp8_fusion._act_quant_kernel
    for name, (width, act) in CASES.items():
        y = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
        n = width // 2 if act == "swiglu" else width
        want_q, want_s = fp8_act_quant(y, act)
        best = getattr(kernel, "best_config", None)
        moved = y.numel() * 2 + m * n + m * 4
        case = {"case": name, "M": m, "width": width, "N": n, "activation": act, "bytes": moved,
                "autotuned_pick": str(best) if best is not None else None,
                "autotuned_ms": _graph_ms(lambda: fp8_act_quant(y, act), args.iters),
                "cast_floor_ms": _graph_ms(lambda: y[:, :n].to(FP8) if act != "swiglu" else y.to(FP8), args.iters),
                "variants": []}
        q = torch.empty(m, n, dtype=FP8, device="cuda")
        s = torch.empty(m, 1, dtype=torch.float32, device="cuda")
        code = ACTIVATIONS.index(act)

        def check(label: str, run) -> None:
            q.zero_()
            run()
            ok = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
            try:
                ms = _graph_ms(run, args.iters)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is a probe result
                case["variants"].append({"variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                return
            case["variants"].append({"variant": label, "ms": ms, "same_bits": ok, "tb_per_s": moved / ms / 1e9})
            print(f"{name:14s} {label:40s} {ms * 1e3:8.1f} us  {moved / ms / 1e9:5.2f} TB/s  same bits {ok}",
                  flush=True)

        for cfg in kernel.configs:  # (at e625df4 the kernel ran one program per row only: the rowwise rows of that run)
            b, w, p = cfg.kwargs["BLOCK"], cfg.num_warps, cfg.kwargs["PER_SM"]
            check(f"{f'looping {p}/SM' if p else 'rowwise'} BLOCK={b} warps={w}",
                  lambda b=b, w=w, p=p: kernel.fn[(min(m, p * sms) if p else m,)](
                      y, q, s, m, y.stride(0), N=n, ACT=code, BLOCK=b, PER_SM=p, num_warps=w))
        block = triton.next_power_of_2(n)
        for per_sm in (2, 4, 8):
            for stages in (1, 2, 3):
                for w in (8, 16):
                    check(f"persistent {per_sm}/SM stages={stages} warps={w}",
                          lambda g=per_sm * sms, st=stages, w=w: _act_quant_persistent[(g,)](
                              y, q, s, m, y.stride(0), N=n, ACT=code, BLOCK=block, STAGES=st, num_warps=w))
        ok = [v for v in case["variants"] if "ms" in v and v["same_bits"]]
        case["best"] = min(ok, key=lambda v: v["ms"]) if ok else None
        print(f"{name}: autotuned {case['autotuned_ms'] * 1e3:.1f} us ({case['autotuned_pick']}), cast floor "
              f"{case['cast_floor_ms'] * 1e3:.1f} us, best {case['best']}", flush=True)
        result["cases"].append(case)
    (out_dir / "act-quant-probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
