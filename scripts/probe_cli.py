"""The GPU probes' shared command line (`act_quant_probe.py`, `fp8_gemm_probe.py`, `fp8_mlp_epilogue_probe.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def probe_parser() -> argparse.ArgumentParser:
    """--out (the folder the probe's JSON goes to), --tokens (a tier-480 request's Generator rows, both CFG branches)
    and --iters (calls per timed CUDA graph); a probe adds its own options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=6184)
    ap.add_argument("--iters", type=int, default=20)
    return ap


def probe_start(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path]:
    """The parsed options and the output folder (made); the random seed fixed."""
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    return args, out_dir
