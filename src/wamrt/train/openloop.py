"""Open-loop error of a checkpoint on recorded expert episodes, in radians, through the served request path.

For every `stride`-th frame of each episode the stored canvas (byte for byte what `prepare_droid` encodes,
see tests/train) and state row go through the checkpoint's DROID contract (normalization included) and the
sampler at the serving settings; the chunk is compared with the expert's next actions. Rows 0..7 are what a
lane executes open loop (`execute_steps` = 8), so they are the numbers that matter closed loop.

    python -m wamrt.train.openloop --demos DIR --checkpoints CKPT [CKPT ...] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def open_loop_chunks(policy: Any, ds: Any, frames: np.ndarray, *, seed: int = 0,
                     prefixes: np.ndarray | None = None) -> np.ndarray:
    """The served chunk [F, chunk, 8] for each stored frame: the frame's canvas latent and state row in the
    request `prepare_droid` builds (request n drawn with seed + n); `prefixes` [F, d, 8] (robot space) go with
    the requests as their `action_prefix`."""
    from ..pipeline.denoise import denoise
    from ..pipeline.droid import droid_actions, prepare_droid

    contract = policy.contract
    if ds.tier != contract.tier:
        raise ValueError(f"demos at tier {ds.tier}, checkpoint at tier {contract.tier}")
    blank = {"observation/image": np.zeros((540, 640, 3), np.uint8)}
    chunks = []
    with torch.inference_mode():
        for n, i in enumerate(frames):
            state = ds.state[i]  # the stored DROID state row: 7 joints, 1 - gripper closure
            obs = {**blank, "observation/joint_position": state[:7], "observation/gripper_position": 1.0 - state[7],
                   "prompt": ds.prompt[i]}
            if prefixes is not None:
                obs["action_prefix"] = prefixes[n]
            prep = prepare_droid(obs, model=policy.model, encoder=policy.encoder, tokenizer=policy.tokenizer,
                                 contract=contract, seed=seed + n, device=policy.device)
            # frame 0 from the stored canvas instead of the blank one (the contract's own crop of the latent)
            pixels = torch.from_numpy(ds.canvas[i]).to(policy.device)[None]
            lat = policy.encoder.encode_uint8(pixels)[..., : prep.inputs.vision.shape[3], : prep.inputs.vision.shape[4]]
            prep.inputs.vision[:, :, :1] = lat.to(prep.inputs.vision.dtype)
            result = denoise(policy.model, prep.inputs, policy.options)
            chunks.append(droid_actions(result, contract, prep.state))
    return np.stack(chunks)


def progress_ratio(chunks: np.ndarray, targets: np.ndarray, first: int, rows: int) -> float:
    """How far the chunks' 7 joints move from row `first` to row `first + rows - 1`, along the expert's own
    displacement over those rows, as a share of it: sum(dp . de) / sum(|de|^2) over frames. 1: the expert's pace;
    below 1: slower (or partly elsewhere); negative: backwards. Displacements, not path lengths, so the expert's
    recorded action noise (`train record --action-noise`) does not count as motion."""
    last = first + rows - 1
    dp = chunks[:, last, :7] - chunks[:, first, :7]
    de = targets[:, last, :7] - targets[:, first, :7]
    return float((dp * de).sum() / max(float((de * de).sum()), 1e-12))


def open_loop_error(checkpoint: str | Path, ds: Any, *, stride: int = 8, rows: int = 8, seed: int = 0,
                    device: str | None = None) -> dict[str, Any]:
    from .. import load_policy
    from .data import chunk_indices

    policy = load_policy(checkpoint, device=device)
    frames = np.concatenate([np.arange(s, e, stride) for s, e in sorted(set(zip(ds.episode_start, ds.episode_end)))])
    targets = ds.actions[chunk_indices(ds, frames, policy.contract.chunk)]  # [F, chunk, 8], client convention
    t0 = time.perf_counter()
    chunks = open_loop_chunks(policy, ds, frames, seed=seed)
    err = np.abs(chunks - targets)  # [F, chunk, 8]
    joints = err[:, :rows, :7]
    return {
        "checkpoint": str(checkpoint), "frames": int(len(frames)), "episodes": int(ds.episodes), "stride": stride,
        "rows": rows, "sampling": {"steps": policy.options.steps, "guidance": policy.options.guidance,
                                   "shift": policy.options.shift},
        "normalization": policy.contract.normalization is not None,
        "joint_abs_err_rad_mean": float(joints.mean()),
        "joint_abs_err_rad_per_joint": joints.mean(axis=(0, 1)).round(5).tolist(),
        "joint_abs_err_rad_p95": float(np.percentile(joints, 95)),
        "row0_joint_abs_err_rad_mean": float(err[:, 0, :7].mean()),
        "rows_24_31_joint_abs_err_rad_mean": float(err[:, 24:32, :7].mean()),
        "gripper_wrong_rate": float((err[:, :rows, 7] > 0.5).mean()),
        "progress_ratio": progress_ratio(chunks, targets, 0, rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def prefix_open_loop(checkpoint: str | Path, ds: Any, d: int, *, stride: int = 8, rows: int = 8, seed: int = 0,
                     device: str | None = None) -> dict[str, Any]:
    """What a checkpoint makes of the committed rows, open loop: rows d..d+rows-1 of the chunk (what a lane runs
    after a reply that took d steps) against the expert's, with no prefix, with the expert's own next d rows as
    the prefix (what training shows the model), and with the rows a lane would really have committed: rows
    stride..stride+d-1 of the model's own no-prefix chunk made `stride` steps earlier (frames with no earlier
    frame in their episode are left out). `own_prefix_joint_abs_err_rad_mean`: how far those rows are from the
    expert's."""
    from .. import load_policy
    from .data import chunk_indices

    policy = load_policy(checkpoint, device=device)
    spans = sorted(set(zip(ds.episode_start, ds.episode_end)))
    frames = np.concatenate([np.arange(s, e, stride) for s, e in spans])
    starts = {int(s) for s, _ in spans}
    targets = ds.actions[chunk_indices(ds, frames, policy.contract.chunk)]  # [F, chunk, 8], client convention
    t0 = time.perf_counter()
    plain = open_loop_chunks(policy, ds, frames, seed=seed)
    later = np.array([int(f) not in starts for f in frames])  # frames whose previous request is frames[k - 1]
    own = plain[np.flatnonzero(later) - 1][:, stride:stride + d]
    chunks = {"none": plain[later],
              "expert": open_loop_chunks(policy, ds, frames[later], seed=seed, prefixes=targets[later][:, :d]),
              "own": open_loop_chunks(policy, ds, frames[later], seed=seed, prefixes=own)}
    want = targets[later][:, d:d + rows, :7]
    out: dict[str, Any] = {"checkpoint": str(checkpoint), "prefix_rows": d, "frames": int(later.sum()),
                           "rows": [d, d + rows - 1], "stride": stride}
    for name, c in chunks.items():
        err = np.abs(c[:, d:d + rows, :7] - want)
        out[f"{name}_joint_abs_err_rad_mean"] = float(err.mean())
        out[f"{name}_joint_abs_err_rad_per_row"] = err.mean(axis=(0, 2)).round(5).tolist()
        out[f"{name}_progress_ratio"] = progress_ratio(c, targets[later], d, rows)
        out[f"{name}_gripper_wrong_rate"] = float(
            (np.abs(c[:, d:d + rows, 7] - targets[later][:, d:d + rows, 7]) > 0.5).mean())
    out["own_prefix_joint_abs_err_rad_mean"] = float(np.abs(own[..., :7] - targets[later][:, :d, :7]).mean())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from .data import load_demo_dirs

    ap = argparse.ArgumentParser(prog="python -m wamrt.train.openloop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--demos", type=Path, required=True, help="episodes from `wamrt train record` (never trained on)")
    ap.add_argument("--checkpoints", nargs="+", required=True)
    ap.add_argument("--stride", type=int, default=8, help="every N-th frame of each episode")
    ap.add_argument("--prefix-rows", type=int, nargs="*", default=[],
                    help="also the prefix comparison (prefix_open_loop) at each of these d")
    ap.add_argument("--device")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        ds = load_demo_dirs([args.demos])
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seeds = sorted(json.loads(str(np.load(f)["meta"]))["seed"] for f in args.demos.glob("*.npz"))
    rows = []
    for ckpt in args.checkpoints:
        r = open_loop_error(ckpt, ds, stride=args.stride, device=args.device)
        rows.append(r)
        print(f"{ckpt}: rows 0-7 joint |err| mean {r['joint_abs_err_rad_mean']:.4f} rad (p95 "
              f"{r['joint_abs_err_rad_p95']:.4f}), row 0 {r['row0_joint_abs_err_rad_mean']:.4f}, rows 24-31 "
              f"{r['rows_24_31_joint_abs_err_rad_mean']:.4f}, gripper wrong {r['gripper_wrong_rate']:.1%}, "
              f"progress {r['progress_ratio']:.3f} of the expert's ({r['frames']} frames, {r['seconds']} s)",
              flush=True)
        for d in args.prefix_rows:
            p = prefix_open_loop(ckpt, ds, d, stride=args.stride, device=args.device)
            rows.append(p)
            print(f"{ckpt} d = {d}: rows {d}-{d + 7} joint |err| mean: no prefix "
                  f"{p['none_joint_abs_err_rad_mean']:.4f}, the expert's rows {p['expert_joint_abs_err_rad_mean']:.4f}"
                  f", its own earlier rows {p['own_joint_abs_err_rad_mean']:.4f} (those rows off the expert's by "
                  f"{p['own_prefix_joint_abs_err_rad_mean']:.4f}; {p['frames']} frames); progress of the expert's: "
                  f"{p['none_progress_ratio']:.3f} / {p['expert_progress_ratio']:.3f} / {p['own_progress_ratio']:.3f}",
                  flush=True)
    if args.out:
        from ..provenance import environment, git_sha

        res = {"kind": "open_loop", "git_sha": git_sha(), **environment(), "demos": str(args.demos),
               "seeds": seeds, "command": " ".join(sys.argv), "results": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
