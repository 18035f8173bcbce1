"""Training throughput of the two augmentation paths, timed in one process on the same demos.

    python -m wamrt.train.throughput --demos DIR [--batch 16 --warmup 2 --steps 10] --out result.json

`frame0` (the default path): frame 0 augmented and VAE-encoded per step, future frames from the clean
latent cache. `aug-future` (`--aug-future`): all 9 frames augmented and encoded per step. Per step: the
batch preparation (pixels -> latents, action rows) and the whole train step; median, p90 and a 95%
bootstrap CI of the median; samples/s from the median step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def _time_mode(ds, aug_future: bool, args: argparse.Namespace) -> dict:
    from ..bench.stats import summarize
    from .trainer import PolicyTrainer, TrainConfig

    cfg = TrainConfig(size=args.size, tier=ds.tier, batch=args.batch, aug_future=aug_future, log_every=10**9)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = PolicyTrainer(cfg, ds, tmp, device=args.device)
        if trainer.uses_latent_cache:
            trainer.cache_latents()
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        prep_ms: list[float] = []
        clean_batch = trainer.clean_batch

        def timed_batch(idx, **kw):
            sync()
            t0 = time.perf_counter()
            out = clean_batch(idx, **kw)
            sync()
            prep_ms.append(1e3 * (time.perf_counter() - t0))
            return out

        trainer.clean_batch = timed_batch  # type: ignore[method-assign]
        steps_ms: list[float] = []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            trainer.train_step(0.0)
            sync()
            if i >= args.warmup:
                steps_ms.append(1e3 * (time.perf_counter() - t0))
        prep_ms = prep_ms[args.warmup:]
    step = summarize(steps_ms)
    return {"step": step, "batch_prep": summarize(prep_ms),
            "samples_per_s": args.batch / (float(step["p50_ms"]) / 1e3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", type=Path, required=True, metavar="DIR")
    ap.add_argument("--size", default="policy-s")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from ..provenance import environment
    from .data import load_demo_dirs

    try:
        ds = load_demo_dirs([args.demos])
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    modes = {name: _time_mode(ds, aug_future, args) for name, aug_future in (("frame0", False), ("aug-future", True))}
    result = {"kind": "train-throughput", **environment(), "command": " ".join(sys.argv),
              "threads": torch.get_num_threads(), "size": args.size, "batch": args.batch, "warmup": args.warmup,
              "steps": args.steps, "episodes": ds.episodes, "frames": len(ds), "tier": ds.tier, "modes": modes,
              "speedup_frame0": modes["frame0"]["samples_per_s"] / modes["aug-future"]["samples_per_s"]}
    for name, m in modes.items():
        s, p = m["step"], m["batch_prep"]
        print(f"{name:>10}: step p50 {s['p50_ms']:.0f} ms CI {s['ci95_p50_ms'][0]:.0f}-{s['ci95_p50_ms'][1]:.0f} "
              f"(batch prep {p['p50_ms']:.0f} ms) -> {m['samples_per_s']:.2f} samples/s")
    print(f"frame0 / aug-future: {result['speedup_frame0']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
