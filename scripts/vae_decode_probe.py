"""The world decode's norm kernels and fused residual blocks (engine/vae_decode.py): full-size Wan2.2 VAE decoder with
random weights, bf16, at the i2v bench's shape (48 x 9 x 30 x 52 latents -> 33 frames of 480 x 832).

    python3 scripts/vae_decode_probe.py --out DIR [--runs 5]

* GPU time of `decode_pixels` (normalised latents -> float pixels on the device, what `WorldEngine.decode_pixels`
  times as `decode_ms`) for diffusers' own modules, the implicit-padding convolutions alone, the convolutions with
  the fused norm + SiLU as the compiled kernel ("compile") and as the Triton row kernel ("rows"), with the fused
  residual blocks too (biases folded, inputs assembled in place), and with the fused up blocks as well (no input
  clone, the duplicating shortcut gathered in its add: the default); median and range of `--runs` after one untimed
  call each (it absorbs compiles and cuDNN's plan choice).
* How far the "rows" decodes are from the "compile" one (bf16 rounding in another order only).
* The kernels of one decode, compiled norms against the default, from torch.profiler, with the time per kind
  (convolution, norm, copy / cat, other).
Writes vae-decode-probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager, nullcontext

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualUpBlock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from wamrt.engine.vae_decode import _FusedResidualUpBlock, implicit_pad_decoder  # noqa: E402
from wamrt.pipeline.omni import decode_pixels  # noqa: E402
from wamrt.pipeline.random_weights import random_vae  # noqa: E402
from wamrt.pipeline.vae import FrameEncoder  # noqa: E402
from wamrt.provenance import environment  # noqa: E402

# Substrings of kernel names per kind, checked in this order (the first match wins).
KINDS = (
    ("norm", ("_norm_kernel", "triton_", "norm")),
    ("convolution", ("conv", "xmma", "cudnn", "implicit_gemm", "sm90", "cutlass", "gemm")),
    ("copy / cat", ("Cat", "copy", "Copy", "Memcpy", "pad")),
)


def kind_of(kernel: str) -> str:
    for kind, needles in KINDS:
        if any(n in kernel for n in needles):
            return kind
    return "other"


def profile_decode(fn, n: int = 30) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total]
    rows.sort(key=lambda r: -r["ms"])
    by_kind: dict[str, float] = {}
    for r in rows:
        by_kind[kind_of(r["kernel"])] = by_kind.get(kind_of(r["kernel"]), 0.0) + r["ms"]
    return {"total_kernel_ms": sum(r["ms"] for r in rows), "by_kind_ms": by_kind, "top": rows[:n]}


@contextmanager
def _without_fused_up_blocks(vae):
    """The default swap with diffusers' own up blocks (the fused residual blocks alone)."""
    with implicit_pad_decoder(vae):
        for m in vae.decoder.modules():
            if type(m) is _FusedResidualUpBlock:
                m.__class__ = WanResidualUpBlock  # what the swap's undo sets again on exit
        yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--latent-shape", default="1,48,9,30,52", help="B,C,T,H,W of the normalised latents")
    args = ap.parse_args()
    dev = torch.device("cuda")
    encoder = FrameEncoder(random_vae(dev, torch.bfloat16))
    vae = encoder.vae
    shape = tuple(int(v) for v in args.latent_shape.split(","))
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dev)
    variants = {
        "diffusers": nullcontext,
        "implicit_pad": lambda: implicit_pad_decoder(vae, fuse_norms=False),
        "implicit_pad_fused_norm_compile": lambda: implicit_pad_decoder(vae, norm_kernel="compile",
                                                                        fuse_blocks=False),
        "implicit_pad_fused_norm_rows": lambda: implicit_pad_decoder(vae, norm_kernel="rows", fuse_blocks=False),
        "implicit_pad_fused_norm_rows_residual_blocks": lambda: _without_fused_up_blocks(vae),
        "implicit_pad_fused_norm_rows_blocks": lambda: implicit_pad_decoder(vae),  # the default
    }
    result: dict = {"latent_shape": list(shape), "variants": {}}
    outputs: dict[str, torch.Tensor] = {}
    for name, swap in variants.items():
        times = []
        for i in range(args.runs + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with swap():
                start.record()
                out = decode_pixels(encoder, latents, to_host=False)
                end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end))
        if name.startswith("implicit_pad_fused"):
            outputs[name] = out
        del out
        row = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "runs": times}
        result["variants"][name] = row
        print(name, {k: round(v, 2) for k, v in row.items() if k != "runs"}, flush=True)
    compiled = outputs["implicit_pad_fused_norm_compile"]
    for name in ("implicit_pad_fused_norm_rows", "implicit_pad_fused_norm_rows_residual_blocks",
                 "implicit_pad_fused_norm_rows_blocks"):
        diff = (outputs[name] - compiled).abs()
        result[f"{name}_vs_compile_abs_diff"] = {"max": diff.max().item(), "mean": diff.mean().item()}
        print(name, "vs compile:", result[f"{name}_vs_compile_abs_diff"], flush=True)
    del outputs, compiled, diff
    for name in ("implicit_pad_fused_norm_compile", "implicit_pad_fused_norm_rows_blocks"):
        with variants[name]():
            result[f"kernels_{name}"] = profile_decode(lambda: decode_pixels(encoder, latents, to_host=False))
        print(name, json.dumps({k: v for k, v in result[f"kernels_{name}"].items() if k != "top"}), flush=True)
        for r in result[f"kernels_{name}"]["top"][:15]:
            print(f"  {r['ms']:8.2f} ms {r['calls']:5d}  {r['kernel']}", flush=True)
    result = {"kind": "vae-decode-probe", "command": " ".join(sys.argv), **environment(), "runs": args.runs, **result}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vae-decode-probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
