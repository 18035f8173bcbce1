"""Issue 14 moonshot: the policy's frame-0 VAE encode (engine/vae_encode.py) at the DROID canvas, full-size Wan2.2 VAE
with random weights, bf16.

    python3 scripts/vae_encode_bench.py --out DIR

* GPU time of the captured encode for the walk's kernel options: the stem's input channels zero-padded to 8
  (`channel_multiple`) and the mid block's attention as two GEMMs (`gemm_attention`), each on and off; then with the
  residual blocks' convolution biases folded into the ops after them (`fold_biases`), then with the per-pixel Triton
  kernels (`channels_last_kernels`), and with cuDNN's timed algorithm choice (`cudnn_benchmark`); with the largest
  error of each against the fp32 encode.
* Host time of a request's encode call: the canvas content padded in the graph from a pinned upload
  (`encode_canvases` today) against the host pad + pageable upload + graph from [-1, 1] pixels it replaced.
* The kernels of one eager encode, before and after, from torch.profiler.
Writes vae-encode-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from wamrt.engine.vae_encode import FirstFrameEncoder  # noqa: E402
from wamrt.pipeline.canvas import compose_droid_canvas, pad_canvas, pad_to_bucket  # noqa: E402
from wamrt.pipeline.droid import encode_canvases  # noqa: E402
from wamrt.pipeline.random_weights import random_vae  # noqa: E402
from wamrt.pipeline.vae import FrameEncoder  # noqa: E402
from wamrt.sample import sample_observation  # noqa: E402


def gpu_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, runs: int) -> tuple[float, float]:
    """(median ms until fn returns, median ms until the GPU is done), each call starting on an idle GPU."""
    calls, dones = [], []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        calls.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        dones.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(calls), statistics.median(dones)


def top_kernels(fn, n: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:110], "ms": e.device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    frames = FrameEncoder(random_vae(dev, torch.bfloat16))
    ref32 = FrameEncoder(random_vae(dev, torch.float32))
    padded = pad_to_bucket(compose_droid_canvas(sample_observation(0)))
    geo = padded.geometry
    content = torch.from_numpy(padded.content)[None].to(dev)
    pixels_u8 = torch.from_numpy(padded.pixels)[None].to(dev)
    want = ref32.encode_uint8(pixels_u8)
    result: dict = {"canvas": list(geo.image_size), "pad_mode": geo.pad_mode, "variants": []}
    old = dict(channels_last_kernels=False)
    variants = [dict(channel_multiple=m, gemm_attention=g, fold_biases=False, **old)
                for m in (1, 8) for g in (False, True)]
    variants += [dict(channel_multiple=8, gemm_attention=True, fold_biases=True, **old),
                 dict(channel_multiple=8, gemm_attention=True, fold_biases=True, channels_last_kernels=True),
                 dict(channel_multiple=8, gemm_attention=True, fold_biases=True, channels_last_kernels=True,
                      cudnn_benchmark=True)]
    for flags in variants:
        enc = FirstFrameEncoder(frames, capture=True, **flags)
        got = enc.encode_content_uint8(content, geo)
        row = {**flags, "graph_ms": gpu_ms(lambda enc=enc: enc.encode_content_uint8(content, geo), args.runs),
               "max_abs_err_vs_fp32": (got - want).abs().max().item()}
        print(row, flush=True)
        result["variants"].append(row)
    result["diffusers_bf16_max_abs_err_vs_fp32"] = (frames.encode_uint8(pixels_u8) - want).abs().max().item()

    # A request's encode call as the engine makes it, and as it was made before (host pad, pageable upload, graph
    # from [-1, 1] pixels).
    new = FirstFrameEncoder(frames, capture=True)
    old = FirstFrameEncoder(frames, capture=True, channel_multiple=1, gemm_attention=False, fold_biases=False,
                            channels_last_kernels=False)

    obs = sample_observation(0)  # made once: its synthetic scenes take ~12 ms (the 6c036aa run timed them per call)

    def before() -> torch.Tensor:
        pixels = pad_to_bucket(compose_droid_canvas(obs)).pixels  # the host pad, done per request
        x = torch.from_numpy(np.stack([pixels])).to(dev)
        return old.encode_uint8(x)

    def today() -> torch.Tensor:
        return encode_canvases(new, [pad_to_bucket(compose_droid_canvas(obs))], dev)[0]

    got = today()
    assert torch.equal(got, new.encode_content_uint8(content, geo)[..., : got.shape[-2], : got.shape[-1]])
    for name, fn in (("before", before), ("today", today)):
        call, done = host_ms(fn, args.runs)
        result[f"request_{name}"] = {"host_ms": call, "until_gpu_done_ms": done}
        print(name, result[f"request_{name}"], flush=True)
    result["compose_and_bucket_host_ms"] = host_ms(lambda: pad_to_bucket(compose_droid_canvas(obs)), args.runs)[0]
    result["host_pad_ms"] = host_ms(lambda: pad_canvas(padded.content, geo), args.runs)[0]
    eager_old = FirstFrameEncoder(frames, channel_multiple=1, gemm_attention=False, fold_biases=False,
                                  channels_last_kernels=False)
    eager_fold = FirstFrameEncoder(frames, channels_last_kernels=False)
    eager_new = FirstFrameEncoder(frames)
    result["kernels_before"] = top_kernels(lambda: eager_old.encode_content_uint8(content, geo))
    result["kernels_fold_biases"] = top_kernels(lambda: eager_fold.encode_content_uint8(content, geo))
    result["kernels_today"] = top_kernels(lambda: eager_new.encode_content_uint8(content, geo))
    for name in ("kernels_before", "kernels_fold_biases", "kernels_today"):
        print(name, json.dumps(result[name][:12], indent=0), flush=True)
    sha = os.environ.get("WAMRT_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    result = {"kind": "vae-encode-bench", "command": " ".join(sys.argv), "git_sha": sha,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "runs": args.runs, **result}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vae-encode-bench.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
