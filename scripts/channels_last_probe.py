"""Issue 14 moonshot: the frame-0 encode's per-pixel kernels (`ops/channels_last.py`) at the Wan2.2 encoder's levels
for the DROID canvas, over tile sizes, against the bytes each moves.

    python3 scripts/channels_last_probe.py --out DIR

For every level (channels x pixels) and kernel (norm + SiLU + shift, residual add, residual add into the padded grid),
the device time of one call captured in a CUDA graph (median of --runs replays of 20 calls each), for each
(rows x padded channels per program, warps) in the sweep, with the effective bandwidth; the default tile is marked.
Writes channels-last-probe.json.
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from wamrt.ops import channels_last as cl  # noqa: E402

LEVELS = ((160, 272, 320), (320, 136, 160), (640, 68, 80), (640, 34, 40))  # the encoder at 544x640 (patchified)
TILE_ELEMENTS = (2048, 4096, 8192)
WARPS = (4, 8)
CALLS = 20


def graph_us(fn, runs: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    default_tile = cl._tile
    rows_out = []
    for c, h, w in LEVELS:
        x = torch.randn(1, c, h, w, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        s = torch.randn_like(x)
        weight, shift = torch.rand(c, 1, 1, device=dev), torch.randn(c, 1, 1, device=dev)
        size = x.numel() * x.element_size()
        kernels = {"norm": (lambda: cl.rms_norm(x, weight, 0.0, True, shift), 2 * size),
                   "add": (lambda: cl.add(x, shift, s), 3 * size),
                   "add_pad": (lambda: cl.add(x, shift, s, pad=(1, 1)), 3 * size)}
        base = default_tile(c)
        for name, (fn, nbytes) in kernels.items():
            for elements in TILE_ELEMENTS:
                for warps in WARPS:
                    block_c = base[1]
                    tile = (max(1, elements // block_c), block_c, warps)
                    cl._tile = lambda _c, tile=tile: tile
                    us = graph_us(fn, args.runs)
                    row = {"kernel": name, "channels": c, "pixels": h * w, "block_rows": tile[0],
                           "block_channels": tile[1], "warps": warps, "us": us, "tb_per_s": nbytes / us / 1e6,
                           "default": tile == base}
                    cl._tile = default_tile
                    print(row, flush=True)
                    rows_out.append(row)
    sha = os.environ.get("WAMRT_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    result = {"kind": "channels-last-probe", "command": " ".join(sys.argv), "git_sha": sha,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "runs": args.runs, "rows": rows_out}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "channels-last-probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
