"""`wamrt bench vae`: the Wan2.2 VAE's two ends as the engines run them, kernel option by kernel option, full size
with random weights (bf16 on CUDA; `--tiny-vae` on the CPU is the smoke test: eager references, fp32).

encode (`vae-encode.json`): the policy's frame-0 encode (`engine/vae_encode.py`) at the DROID canvas.
* The encode (captured in a CUDA graph, as the engine runs it) with the first-frame walk's options added one at a
  time in the order they landed: none; the stem's input channels zero-padded to 8 (`channel_multiple`); the mid
  block's attention as two GEMMs (`gemm_attention`); the residual blocks' convolution biases folded into the ops
  after them (`fold_biases`); the per-pixel Triton kernels (`channels_last_kernels`: the default); then the default
  with cuDNN's timed algorithm choice (`cudnn_benchmark`). Each with its largest error against the fp32 encode.
* A request's canvas, bucket and encode call on the host's clock: from the canvas content, padded inside the encode
  (the default), and from the canvas padded on the host, uploaded from pageable memory
  (`EngineConfig.canvas_on_device=False`); the canvas and bucket alone (`compose_and_bucket`) and the host pad alone.
* The kernels of one eager encode, every option off against the default (torch.profiler).

decode (`vae-decode.json`): the world decode (`engine/vae_decode.py`) at the i2v bench's latents (48 x 9 x 30 x 52
-> 33 frames of 480 x 832), normalised latents -> float pixels on the device (what `WorldEngine` times as
`decode_ms`).
* diffusers' own modules; the implicit-padding convolutions alone; with the fused norm + SiLU as the compiled kernel
  and as the Triton row kernel; with the fused residual blocks too; with the fused up blocks as well (the default).
* How far the row-kernel decodes are from the compiled-norm one (bf16 rounding in another order only).
* The kernels of the compiled-norm decode and of the default one, with the time per kind.

Times are GPU time (CUDA events) on CUDA, wall time elsewhere: median and bootstrap CI after one untimed call (it
absorbs compiles, cuDNN's plan choice and the graph capture).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from ..provenance import environment
from .stats import device_ms, summarize

STAGES = ("encode", "decode")

# Substrings of kernel (CUDA) or op (CPU) names per kind, checked in this order: the first match wins.
KINDS = (
    ("norm", ("_norm_kernel", "triton_", "norm")),
    ("convolution", ("conv", "xmma", "cudnn", "implicit_gemm", "sm90", "cutlass", "gemm")),
    ("copy / cat", ("Cat", "aten::cat", "copy", "Copy", "Memcpy", "pad")),
)

# The first-frame walk's options, cumulative, in the order they landed (H200: 3.57 -> 2.30 ms at 9af88cc).
_WALK_OFF = dict(channel_multiple=1, gemm_attention=False, fold_biases=False, channels_last_kernels=False)
ENCODE_VARIANTS: dict[str, dict] = {
    "none": _WALK_OFF,
    "+channel_multiple": {**_WALK_OFF, "channel_multiple": 8},
    "+gemm_attention": {**_WALK_OFF, "channel_multiple": 8, "gemm_attention": True},
    "+fold_biases": {**_WALK_OFF, "channel_multiple": 8, "gemm_attention": True, "fold_biases": True},
    "+channels_last_kernels": {},  # the default
    "default+cudnn_benchmark": {"cudnn_benchmark": True},
}


def kind_of(kernel: str) -> str:
    for kind, needles in KINDS:
        if any(n in kernel for n in needles):
            return kind
    return "other"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(fn: Callable[[], object], runs: int, device: torch.device) -> dict:
    """Each call from an idle device: how long until it returns (host time), and until the device is done."""
    fn()
    calls, dones = [], []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        calls.append(1e3 * (time.perf_counter() - t0))
        _sync(device)
        dones.append(1e3 * (time.perf_counter() - t0))
    return {"host": summarize(calls), "until_done": summarize(dones)}


def kernel_profile(fn: Callable[[], object], device: torch.device, top: int = 25) -> dict:
    """One call under torch.profiler: the kernels (CUDA) or ops' own time (CPU), largest first, and the sum per kind."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        _sync(device)
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type.name != "CUDA":
            continue
        ms = (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3
        if ms > 0:
            rows.append({"kernel": e.key[:120], "ms": ms, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    by_kind: dict[str, float] = {}
    for r in rows:
        by_kind[kind_of(r["kernel"])] = by_kind.get(kind_of(r["kernel"]), 0.0) + r["ms"]
    return {"total_ms": sum(r["ms"] for r in rows), "by_kind_ms": by_kind, "top": rows[:top]}


def _print_kernels(name: str, profile: dict) -> None:
    print(f"{name}: {profile['total_ms']:.2f} ms of kernels, " +
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(profile["by_kind_ms"].items(), key=lambda kv: -kv[1])),
          flush=True)
    for r in profile["top"][:12]:
        print(f"  {r['ms']:8.3f} ms {r['calls']:5d}  {r['kernel']}", flush=True)


def bench_encode(device: torch.device, dtype: torch.dtype, tiny: bool, runs: int, tier: str) -> dict:
    from ..engine.vae_encode import FirstFrameEncoder
    from ..pipeline.canvas import compose_droid_canvas, pad_canvas, pad_to_bucket
    from ..pipeline.droid import encode_canvases
    from ..pipeline.random_weights import random_vae
    from ..pipeline.vae import FrameEncoder
    from ..sample import sample_observation

    frames = FrameEncoder(random_vae(device, dtype, tiny=tiny))
    fp32 = FrameEncoder(random_vae(device, torch.float32, tiny=tiny))  # same seed: the same weights
    obs = sample_observation(0)  # made once: its synthetic scenes take ~12 ms, not a request's cost
    padded = pad_to_bucket(compose_droid_canvas(obs), tier)
    geo = padded.geometry
    content = torch.from_numpy(padded.content)[None].to(device)
    want = fp32.encode_uint8(torch.from_numpy(padded.pixels)[None].to(device))
    result: dict = {"tier": tier, "canvas": list(geo.image_size), "pad_mode": geo.pad_mode, "variants": {}}
    for name, flags in ENCODE_VARIANTS.items():
        enc = FirstFrameEncoder(frames, capture=True, **flags)
        got = enc.encode_content_uint8(content, geo)
        row = {"flags": flags, **summarize(device_ms(lambda enc=enc: enc.encode_content_uint8(content, geo), runs,
                                                     device)),
               "max_abs_err_vs_fp32": (got - want).abs().max().item()}
        result["variants"][name] = row
        lo, hi = row["ci95_p50_ms"]
        print(f"encode {name:24s} {row['p50_ms']:8.3f} ms (CI {lo:.3f}-{hi:.3f}), "
              f"max |err| vs fp32 {row['max_abs_err_vs_fp32']:.4f}", flush=True)
    result["diffusers_max_abs_err_vs_fp32"] = (frames.encode_uint8(torch.from_numpy(padded.pixels)[None].to(device))
                                               - want).abs().max().item()

    # A request's encode call as the engine makes it (the canvas travels as content) and with the host padding it.
    enc = FirstFrameEncoder(frames, capture=True)
    content_path = encode_canvases(enc, [padded], device)[0]
    host_path = encode_canvases(enc, [padded], device, pad_on_device=False)[0]
    result["request_paths_max_abs_diff"] = (content_path - host_path).abs().max().item()
    for name, on_device in (("content", True), ("host_pad", False)):
        result[f"request_{name}"] = host_ms(
            lambda on_device=on_device: encode_canvases(enc, [pad_to_bucket(compose_droid_canvas(obs), tier)], device,
                                                        pad_on_device=on_device), runs, device)
        r = result[f"request_{name}"]
        print(f"request from {name}: host {r['host']['p50_ms']:.3f} ms, until done {r['until_done']['p50_ms']:.3f} ms",
              flush=True)
    # Host work of every request before its encode call, and the pad the content path moved off the host.
    result["compose_and_bucket"] = host_ms(lambda: pad_to_bucket(compose_droid_canvas(obs), tier), runs,
                                           device)["host"]
    result["host_pad_canvas"] = host_ms(lambda: pad_canvas(padded.content, geo), runs, device)["host"]
    for name, flags in (("none", ENCODE_VARIANTS["none"]), ("default", {})):
        eager = FirstFrameEncoder(frames, **flags)
        eager.encode_content_uint8(content, geo)  # compiles and plans outside the profile
        result[f"kernels_{name}"] = kernel_profile(lambda eager=eager: eager.encode_content_uint8(content, geo), device)
        _print_kernels(f"encode kernels, {name}", result[f"kernels_{name}"])
    return result


@contextmanager
def _without_fused_up_blocks(vae: torch.nn.Module):
    """The default swap with diffusers' own up blocks again (the fused residual blocks alone)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualUpBlock

    from ..engine.vae_decode import _FusedResidualUpBlock, implicit_pad_decoder

    with implicit_pad_decoder(vae):
        for m in vae.decoder.modules():
            if type(m) is _FusedResidualUpBlock:
                m.__class__ = WanResidualUpBlock  # the swap's undo sets the class again on exit
        yield


def bench_decode(device: torch.device, dtype: torch.dtype, tiny: bool, runs: int, shape: tuple[int, ...]) -> dict:
    from ..engine.vae_decode import implicit_pad_decoder
    from ..pipeline.omni import decode_pixels
    from ..pipeline.random_weights import random_vae
    from ..pipeline.vae import FrameEncoder

    encoder = FrameEncoder(random_vae(device, dtype, tiny=tiny))
    vae = encoder.vae
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)
    variants = {
        "diffusers": nullcontext,
        "implicit_pad": lambda: implicit_pad_decoder(vae, fuse_norms=False),
        "implicit_pad_fused_norm_compile": lambda: implicit_pad_decoder(vae, norm_kernel="compile", fuse_blocks=False),
        "implicit_pad_fused_norm_rows": lambda: implicit_pad_decoder(vae, norm_kernel="rows", fuse_blocks=False),
        "implicit_pad_fused_norm_rows_residual_blocks": lambda: _without_fused_up_blocks(vae),
        "implicit_pad_fused_norm_rows_blocks": lambda: implicit_pad_decoder(vae),  # the default
    }
    result: dict = {"latent_shape": list(shape), "variants": {}}
    outputs: dict[str, torch.Tensor] = {}
    for name, swap in variants.items():
        def decode(swap=swap) -> torch.Tensor:
            with swap():
                return decode_pixels(encoder, latents, to_host=False)

        row = summarize(device_ms(decode, runs, device))
        result["variants"][name] = row
        if name.startswith("implicit_pad_fused"):
            outputs[name] = decode()
        print(f"decode {name:45s} {row['p50_ms']:9.2f} ms (CI {row['ci95_p50_ms'][0]:.2f}-"
              f"{row['ci95_p50_ms'][1]:.2f})", flush=True)
    compiled = outputs.pop("implicit_pad_fused_norm_compile")
    for name, out in outputs.items():
        diff = (out - compiled).abs()
        result[f"{name}_vs_compile_abs_diff"] = {"max": diff.max().item(), "mean": diff.mean().item()}
    del outputs, compiled
    for name in ("implicit_pad_fused_norm_compile", "implicit_pad_fused_norm_rows_blocks"):
        with variants[name]():
            result[f"kernels_{name}"] = kernel_profile(lambda: decode_pixels(encoder, latents, to_host=False), device)
        _print_kernels(f"decode kernels, {name}", result[f"kernels_{name}"])
    return result


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; known: {list(STAGES)}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    vae = "tiny" if args.tiny_vae else "wan2.2"
    for stage in args.stages:
        if stage == "encode":
            result = bench_encode(device, dtype, args.tiny_vae, args.encode_runs, args.tier)
            runs = args.encode_runs
        else:
            result = bench_decode(device, dtype, args.tiny_vae, args.decode_runs, args.latent_shape)
            runs = args.decode_runs
        record = {"kind": f"vae-{stage}", "command": f"wamrt bench vae --stages {stage} --encode-runs "
                  f"{args.encode_runs} --tier {args.tier} --decode-runs {args.decode_runs} --latent-shape "
                  f"{','.join(map(str, args.latent_shape))}{' --tiny-vae' if args.tiny_vae else ''}",
                  **env, "vae": vae, "dtype": str(dtype).removeprefix("torch."), "weights": "random", "runs": runs,
                  **result}
        path = out / f"vae-{stage}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({"out": str(path)}), flush=True)
    return 0
