"""What a training run writes: the folder `wamrt serve --model` loads.

transformer/ (the EMA weights in bf16) and wamrt.json (the DROID contract the weights were trained for, the action
normalization, whether they learnt prefixes, and the run's settings and data) next to the vae/ and tokenizer/ the
trainer wrote first.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..model import Cosmos3Transformer, save_transformer
from ..pipeline.normalization import KEY as NORM_KEY
from ..pipeline.normalization import ActionNormalization
from ..pipeline.prefix import TRAINED_KEY
from ..provenance import environment
from .config import TrainConfig
from .data import DemoSet

FORMAT_VERSION = 1


def ema_model(config: Any, weights: list[torch.Tensor]) -> Cosmos3Transformer:
    """A fresh model of `config` holding `weights` (in parameter order), on the CPU, in eval mode."""
    model = Cosmos3Transformer(config)
    with torch.no_grad():
        for p, e in zip(model.parameters(), weights, strict=True):
            p.copy_(e.cpu())
    return model.eval()


def data_summary(ds: DemoSet) -> dict[str, int]:
    def count(flags: Any) -> int:
        return 0 if flags is None else int(flags.sum())

    return {"episodes": ds.episodes, "frames": len(ds),
            "dagger_frames": 0 if ds.chunk_row is None else int((ds.chunk_row >= 0).sum()),
            "dagger_grasps_unseen": count(ds.grasp_unseen), "dagger_gripper_disagreements": count(ds.grip_disagrees)}


def checkpoint_meta(cfg: TrainConfig, normalization: ActionNormalization | None, *, steps: int, samples: int,
                    elapsed_s: float, train: dict[str, Any]) -> dict[str, Any]:
    """wamrt.json: `train` holds the run's own record (data, steps, the kept-best step, the command)."""
    noise = {"noise": cfg.prefix_noise, "noise_return_rows": cfg.prefix_noise_rows} if cfg.prefix_noise else {}
    prefix = {TRAINED_KEY: True, "action_prefix": {"max_rows": cfg.prefix_max, "zero_share": cfg.prefix_zero_share,
                                                   **noise}} if cfg.prefix_max else {}
    return {"format_version": FORMAT_VERSION, "contract": "droid", "prompt_format": "plain", "tier": cfg.tier,
            "guidance_interval": None, **prefix,
            **({NORM_KEY: normalization.to_json()} if normalization is not None else {}),
            "weights": f"trained by wamrt.train (EMA {cfg.ema}), {steps} steps, {samples} samples",
            "train": {**asdict(cfg), **train, "steps": steps, "elapsed_s": round(elapsed_s, 1)},
            "provenance": environment()}


def write_checkpoint(out: Path, model: Cosmos3Transformer, meta: dict[str, Any], *,
                     assets_from: Path | None = None) -> Path:
    """transformer/ and wamrt.json into `out`; `assets_from` (a snapshot elsewhere): copy its vae/ and tokenizer/
    so that `out` is a complete checkpoint too."""
    if assets_from is not None and assets_from != out:
        for part in ("vae", "tokenizer"):
            shutil.copytree(assets_from / part, out / part, dirs_exist_ok=True)
    save_transformer(model.to(torch.bfloat16), out / "transformer")
    (out / "wamrt.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
