"""How far each lossy setting moves the trained policy's action chunks, open loop, on recorded requests.

The 2026-12-02 paired gates (bench/results/rollout/2026-12-02-8fc9a24f-panda-droid-isolated/) failed `gen-fp8`
(157 vs 178 of 200) while CFG on the first step only passed (179): this asks whether the served gen-fp8 engine moves
the chunks more than its own reference does (a kernel fault at the policy's small widths would), and how each setting
compares with the ones whose closed-loop verdict is known.

    python3 scripts/policy_drift.py collect --episodes 6 --out requests.pkl.gz      # any device: rollouts, recorded
    python3 scripts/policy_drift.py drift --requests requests.pkl.gz --out DIR      # the variants below

`collect` rolls the checkpoint out on seeds 5000.. (the gates use 0..199) and records every request with its seed.
`drift` computes each request's chunk once per variant with the request's own seed (the same noise everywhere) and
reports, against the served bf16 engine, the relative L2 of the whole chunk and of the 8 rows a rollout executes,
and the RMS per action dimension. Writes DIR/policy-drift.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from wamrt.engine import Engine  # noqa: E402
from wamrt.engine.config import EngineConfig  # noqa: E402
from wamrt.pipeline.policy import Policy, load_policy  # noqa: E402
from wamrt.quant import FP8_W8A8, Recipe, Rule, get_recipe, quantize_model  # noqa: E402
from wamrt.quant.recipes import GENERATOR_LINEARS  # noqa: E402

CHECKPOINT = "src/wamrt/assets/panda-droid"
EXECUTED_ROWS = 8  # what `wamrt rollout` runs of each chunk (--execute-steps default)
_LAYER = r"layers\.\d+\."


def fp8_except(pattern: str) -> Recipe:
    """gen-fp8 with the Generator linears whose names fully match `pattern` left in bf16."""
    rules = tuple(rf"(?!{pattern}$){g}" for g in GENERATOR_LINEARS)
    return Recipe(f"gen-fp8-except:{pattern}", tuple(Rule(r, FP8_W8A8) for r in rules))


def collect(args: argparse.Namespace) -> None:
    from wamrt.eval.agents import PolicyAgent
    from wamrt.eval.runner import run_rollouts

    policy = load_policy(args.checkpoint, device=args.device)
    records: list[tuple[dict, int]] = []

    class Recording:
        def infer(self, obs, **kw):
            records.append((obs, kw["seed"]))
            return policy.infer(obs, **kw)

    agent = PolicyAgent(Recording())
    seeds = list(range(args.seed0, args.seed0 + args.episodes))
    results = run_rollouts("pick_place", lambda: agent, seeds, lanes=1, backend="thread")
    with gzip.open(args.out, "wb") as f:
        pickle.dump({"checkpoint": args.checkpoint, "seeds": seeds, "successes": [r.success for r in results],
                     "device": str(policy.device), "requests": records}, f)
    print(f"{len(records)} requests from {len(seeds)} episodes ({sum(r.success for r in results)} successes)")


def drift(args: argparse.Namespace) -> None:
    with gzip.open(args.requests, "rb") as f:
        recorded = pickle.load(f)
    requests = recorded["requests"][:: args.stride]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    served = dict(prompt_bucket=64, isolate_requests=True) if cuda else dict(attention="auto", compile=False,
                                                                              cuda_graph=False)

    def policy(dtype=torch.bfloat16, recipe: Recipe | None = None, kernel: str = "auto") -> Policy:
        p = load_policy(args.checkpoint, device=dev, dtype=dtype)
        if recipe is not None:
            quantize_model(p.model, recipe, kernel=kernel)
        return p

    def engine(recipe: Recipe | None = None, **config) -> Engine:
        return Engine.from_policy(policy(recipe=recipe), EngineConfig(**{**served, **config}))

    gen_fp8 = get_recipe("gen-fp8")
    variants: dict[str, Callable[[], tuple[object, dict]]] = {
        "engine bf16 (served)": lambda: (engine(), {}),
        "eager bf16": lambda: (policy(), {}),
        "eager fp32": lambda: (policy(torch.float32), {}),
        "engine bf16, 2 steps (gate: fail)": lambda: (engine(), {"steps": 2}),
        "engine bf16, CFG on step 1 only (gate: pass)": lambda: (engine(), {"guidance_interval": (937, 1000)}),
        "engine gen-fp8 (served; gate: fail)": lambda: (engine(gen_fp8), {}),
        "engine gen-fp8, precise accumulation": lambda: (engine(gen_fp8, fp8_fast_accum=False), {}),
        "eager gen-fp8, scaled_mm": lambda: (policy(recipe=gen_fp8), {}),
        "eager gen-fp8, reference kernel (fp32 dequantized)": lambda: (policy(recipe=gen_fp8, kernel="reference"), {}),
        "engine gen-fp8, down-projection bf16": lambda: (engine(fp8_except(_LAYER + r"mlp_moe_gen\.down_proj")), {}),
        "engine gen-fp8, gate/up bf16": lambda: (engine(fp8_except(_LAYER + r"mlp_moe_gen\.gate_up_proj")), {}),
        "engine gen-fp8, layer 0 bf16": lambda: (engine(get_recipe("gen-fp8-skip-first")), {}),
    }
    if not cuda:  # cuBLAS's precise accumulation and torch._scaled_mm are CUDA kernels
        variants = {k: v for k, v in variants.items() if "precise" not in k and "scaled_mm" not in k}

    chunks: dict[str, np.ndarray] = {}
    report: dict[str, dict] = {}
    for name, build in variants.items():
        runner, overrides = build()
        t0 = time.perf_counter()
        got = np.stack([np.asarray(runner.infer(obs, seed=seed, **overrides).actions, np.float64)
                        for obs, seed in requests])
        chunks[name] = got
        ref = chunks["engine bf16 (served)"]
        rel = np.linalg.norm(got - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
        d8 = (got - ref)[:, :EXECUTED_ROWS]
        rel8 = np.linalg.norm(d8, axis=(1, 2)) / np.linalg.norm(ref[:, :EXECUTED_ROWS], axis=(1, 2))
        report[name] = {"rel_l2_chunk_median": float(np.median(rel)),
                        "rel_l2_executed_median": float(np.median(rel8)), "rel_l2_executed_mean": float(rel8.mean()),
                        "rel_l2_executed_p90": float(np.quantile(rel8, 0.9)),
                        "rms_executed_per_dim": np.sqrt((d8 ** 2).mean((0, 1))).round(5).tolist(),
                        "mean_executed_per_dim": d8.mean((0, 1)).round(5).tolist(),
                        "seconds": round(time.perf_counter() - t0, 1)}
        r = report[name]
        print(f"{name:52s} chunk {r['rel_l2_chunk_median']:.4f}  executed median {r['rel_l2_executed_median']:.4f}"
              f" mean {r['rel_l2_executed_mean']:.4f} p90 {r['rel_l2_executed_p90']:.4f}", flush=True)
        del runner
        if cuda:
            torch.cuda.empty_cache()
        _write(args, recorded, requests, chunks["engine bf16 (served)"], report)


def _write(args: argparse.Namespace, recorded: dict, requests: list, ref: np.ndarray, report: dict) -> None:
    """DIR/policy-drift.json with the variants so far (rewritten after each: a cut run keeps what it measured)."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sha = os.environ.get("WAMRT_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    result = {"kind": "policy_drift", "command": " ".join(sys.argv), "git_sha": sha or None,
              "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
              "checkpoint": args.checkpoint, "requests": len(requests), "episodes": recorded["seeds"],
              "recorded_on": recorded["device"], "reference": "engine bf16 (served)",
              "reference_rms_per_dim": np.sqrt((ref[:, :EXECUTED_ROWS] ** 2).mean((0, 1))).round(5).tolist(),
              # the spread a dimension's error compares with (its RMS above is mostly the absolute joint angle)
              "reference_std_per_dim": ref[:, :EXECUTED_ROWS].std((0, 1)).round(5).tolist(),
              "variants": report}
    (out / "policy-drift.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--episodes", type=int, default=6)
    c.add_argument("--seed0", type=int, default=5000)
    c.add_argument("--out", required=True)
    d = sub.add_parser("drift")
    d.add_argument("--requests", required=True)
    d.add_argument("--stride", type=int, default=1, help="use every n-th recorded request")
    d.add_argument("--out", required=True)
    for p in (c, d):
        p.add_argument("--checkpoint", default=CHECKPOINT)
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    collect(args) if args.cmd == "collect" else drift(args)


if __name__ == "__main__":
    main()
