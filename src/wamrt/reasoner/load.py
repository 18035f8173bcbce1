"""Find and load the Reasoner's parts the transformer loader leaves out: `lm_head` and the vision tower.

Two checkpoint layouts:
* the hub layout: a root `model.safetensors.index.json` whose weight map points into `transformer/*.safetensors`
  and `vision_encoder/*.safetensors` (vision keys are bare `Qwen3VLVisionModel` names), `vision_encoder/config.json`;
* our diffusers-layout folders: `transformer/` (or a bare transformer folder) whose safetensors hold `lm_head.weight`
  (diffusers' `Cosmos3OmniTransformer` keeps it), optionally `vision_encoder/` beside it.

A checkpoint without `vision_encoder/` serves text only; one without `lm_head.weight` has no Reasoner text at all.
Edge's vision tower (a SigLIP2 variant with its own projector and no DeepStack, which transformers does not ship as
a model class) is not loaded: Edge is text only here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .builtin import ROOT_INDEX

LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def checkpoint_root(name: str) -> Path | None:
    """The folder of a checkpoint path or built-in name; None for `random:SIZE` and unknown names."""
    from ..pipeline.builtin import BUILTIN_MODELS, builtin_path

    if not name or name.startswith("random:"):
        return None
    if name in BUILTIN_MODELS:
        return builtin_path(name)
    p = Path(name)
    return p if p.exists() else None


def _index_map(index: Path) -> dict[str, Path]:
    weight_map = json.loads(index.read_text())["weight_map"]
    return {k: index.parent / f for k, f in weight_map.items()}


def _folder_map(folder: Path) -> dict[str, Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        return _index_map(indexes[0])
    out: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def weight_files(root: Path) -> dict[str, Path]:
    """Every tensor key of the checkpoint -> its file: the root index when there is one, else transformer/ (or the
    folder itself) and vision_encoder/ read one by one."""
    if (root / ROOT_INDEX).is_file():
        return _index_map(root / ROOT_INDEX)
    out: dict[str, Path] = {}
    transformer = root / "transformer" if (root / "transformer").is_dir() else root
    out.update(_folder_map(transformer))
    if transformer.name == "transformer" and (root / "vision_encoder").is_dir():
        out.update(_folder_map(root / "vision_encoder"))
    return out


def vision_parts(root: Path, files: dict[str, Path]) -> tuple[Path, list[Path]] | None:
    """(vision_encoder folder, the shards that hold its tensors), or None when the checkpoint has no tower."""
    for folder in (root / "vision_encoder", root.parent / "vision_encoder"):
        if (folder / "config.json").is_file():
            shards = sorted({f for f in files.values() if f.parent.resolve() == folder.resolve()})
            return folder, shards or sorted(folder.glob("*.safetensors"))
    return None


def load_lm_head(files: dict[str, Path], *, device: torch.device | str, dtype: torch.dtype) -> nn.Linear | None:
    key = next((k for k in LM_HEAD_KEYS if k in files), None)
    if key is None:
        return None
    with safe_open(str(files[key]), framework="pt", device="cpu") as f:
        weight = f.get_tensor(key)
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    return head.eval()


def random_lm_head(model: Any, seed: int = 0) -> nn.Linear:
    """A seeded random head for random-weight models (`random:SIZE`, benchmarks)."""
    w = model.embed_tokens.weight
    gen = torch.Generator(device=w.device).manual_seed(seed)
    vocab, hidden = w.shape
    weight = torch.randn(vocab, hidden, generator=gen, device=w.device, dtype=torch.float32) / hidden**0.5
    head = nn.Linear(hidden, vocab, bias=False, device="meta")
    head.weight = nn.Parameter(weight.to(w.dtype), requires_grad=False)
    return head.eval()


def reasoner_of(policy: Any, checkpoint: str, *, max_len: int = 8192, max_pixels: int | None = None
                ) -> tuple[Any | None, str]:
    """The served policy's Reasoner as a chat model (`engine.Reasoner`), or (None, why not)."""
    from ..model import Cosmos3Transformer
    from .engine import Reasoner
    from .lm import ReasonerLM
    from .vision import VisionTower

    model = getattr(policy, "model", None)
    if not isinstance(model, Cosmos3Transformer):
        return None, "the served engine exposes no Cosmos 3 transformer"
    hf_tok = getattr(getattr(policy, "tokenizer", None), "tokenizer", None)
    if hf_tok is None or getattr(hf_tok, "chat_template", None) is None:
        return None, "the checkpoint's tokenizer has no chat template (random-weight stand-in?)"
    names = [n for n in dict.fromkeys((str(getattr(policy, "name", "") or ""), checkpoint)) if n]
    root = next((r for r in map(checkpoint_root, names) if r is not None), None)
    if root is None:
        return None, "no checkpoint folder to read lm_head from"
    files = weight_files(root)
    p = model.embed_tokens.weight
    head = load_lm_head(files, device=p.device, dtype=p.dtype)
    if head is None:
        return None, f"{root}: the checkpoint has no lm_head.weight"
    vision = None
    parts = vision_parts(root, files)
    if parts is not None and model.config.gated_mlp:
        vision = VisionTower.from_folder(parts[0], parts[1], device=p.device, dtype=p.dtype, max_pixels=max_pixels)
    return Reasoner(ReasonerLM(model, head), hf_tok, vision, max_len=max_len, name=str(root)), "ok"
