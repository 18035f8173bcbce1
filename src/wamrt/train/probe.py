"""Is a frozen random VAE good enough? A linear probe of object positions from frame-0 latents.

The policy trains its transformer on latents of a VAE that is never trained (`TrainConfig.vae_seed`).
That is only sound if the latents keep where things are. This probe renders the first observation of
many seeded episodes, encodes it through the exact serving path (canvas -> bucket pad -> VAE, content
crop), and fits ridge regressions from the flattened latent to the cube and pad positions on the table
(ground truth from the seed's layout). Held-out R^2 near 1 means the information is linearly there;
the transformer can then learn to use it. The same probe on a 4x-downsampled canvas is the baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def ridge_r2(x: np.ndarray, y: np.ndarray, *, folds: int = 5, alphas=(1e-2, 1e-1, 1.0, 10.0, 100.0),
             seed: int = 0) -> tuple[float, float]:
    """Best-alpha k-fold held-out R^2 (averaged over targets) of a ridge fit x -> y; returns (r2, alpha)."""
    n = len(x)
    order = np.random.default_rng(seed).permutation(n)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    best = (-np.inf, alphas[0])
    for alpha in alphas:
        pred = np.zeros_like(y)
        for f in range(folds):
            test = order[f::folds]
            train = np.setdiff1d(order, test)
            xt, yt = x[train], y[train]
            mu = yt.mean(0)
            # Dual form: n_train << features (latents are ~14k numbers).
            k = xt @ xt.T
            coef = np.linalg.solve(k + alpha * np.eye(len(k)), yt - mu)
            pred[test] = x[test] @ (xt.T @ coef) + mu
        ss_res = ((y - pred) ** 2).sum(0)
        ss_tot = ((y - y.mean(0)) ** 2).sum(0)
        r2 = float(np.mean(1 - ss_res / ss_tot))
        if r2 > best[0]:
            best = (r2, alpha)
    return best


def run_probe(task: str, episodes: int, vae_dir: str | None, tier: str, vae_seed: int, seed0: int = 0) -> dict:
    import tempfile

    import torch

    from ..pipeline.builtin import write_vae
    from ..pipeline.vae import FrameEncoder, load_vae
    from ..sim.droid import droid_observation
    from ..sim.env import PandaEnv
    from .data import policy_canvas

    if vae_dir is None:
        vae_dir = str(Path(tempfile.mkdtemp()) / "vae")
        write_vae(Path(vae_dir), vae_seed)
    encoder = FrameEncoder(load_vae(vae_dir, device="cpu", dtype=torch.float32))
    latents, pixels, targets = [], [], []
    t0 = time.perf_counter()
    with PandaEnv(task) as env, torch.no_grad():
        for s in range(seed0, seed0 + episodes):
            obs = env.reset(s)
            canvas, size = policy_canvas(droid_observation(obs), tier)
            x = torch.from_numpy(canvas).permute(2, 0, 1).float()[None, :, None] / 127.5 - 1.0
            lat = encoder.encode(x)[0, :, 0]  # [C, h, w] of the padded bucket
            lh, lw = -(-size[2] // 16), -(-size[3] // 16)
            latents.append(lat[:, :lh, :lw].flatten().numpy())
            small = torch.nn.functional.avg_pool2d(x[0, :, 0], 4)
            pixels.append(small.flatten().numpy())
            lay = env.layout
            targets.append(np.concatenate([lay.cube_xy[lay.target], lay.pad_xy]))
    y = np.array(targets)
    cols = [i for i in range(y.shape[1]) if y[:, i].std() > 1e-6]  # tasks without a pad park it: constant
    y = y[:, cols]
    r2_lat, a_lat = ridge_r2(np.array(latents), y)
    r2_pix, a_pix = ridge_r2(np.array(pixels), y)
    names = ["cube_x", "cube_y", "pad_x", "pad_y"]
    return {"kind": "quality", "probe": "ridge regression frame-0 latent -> object positions",
            "task": task, "episodes": episodes, "tier": tier, "vae_seed": vae_seed, "targets": [names[i] for i in cols],
            "latent_features": int(len(latents[0])), "r2_latent": r2_lat, "alpha_latent": a_lat,
            "pixel_features": int(len(pixels[0])), "r2_pixels_4x_downsampled": r2_pix, "alpha_pixels": a_pix,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wamrt.train.probe", description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="pick_place")
    ap.add_argument("--episodes", type=int, default=300)
    ap.add_argument("--tier", default="256")
    ap.add_argument("--vae", default=None, help="a vae/ folder (default: the frozen one training builds)")
    ap.add_argument("--vae-seed", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from ..eval.results import common_fields

    result = {**common_fields("quality"), **run_probe(args.task, args.episodes, args.vae, args.tier, args.vae_seed)}
    print(json.dumps({k: result[k] for k in ("task", "episodes", "r2_latent", "r2_pixels_4x_downsampled",
                                             "seconds")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
