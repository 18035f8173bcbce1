"""Load the Reasoner's parts the transformer loader leaves out: `lm_head` and the vision tower.

Where they are is `pipeline.layout.resolve_layout`'s answer, so every layout the policy loads from serves chat too
(a diffusers `save_pretrained` folder, a hub repository with a root weight index, wamrt's own, a bare transformer
folder): `lm_head.weight` among the transformer's tensors (diffusers' `Cosmos3OmniTransformer` keeps it; a hub root
index may prefix it `transformer.`), the vision tower in `vision_encoder/` (bare `Qwen3VLVisionModel` names).

A checkpoint without `vision_encoder/` serves text only; one without `lm_head.weight` has no Reasoner text at all.
Edge's vision tower (a SigLIP2 variant with its own projector and no DeepStack, which transformers does not ship as
a model class) is not loaded: Edge is text only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..model import CheckpointError
from ..model.checkpoint import weight_files
from ..pipeline.layout import CheckpointLayout, resolve_layout

LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def served_layout(policy: Any, checkpoint: str, *, tokenizer: str | Path | None = None,
                  vae: str | Path | None = None) -> CheckpointLayout | None:
    """The layout the policy was loaded from (`Policy.layout`, its `--tokenizer` / `--vae` already applied), else
    that of the policy's name or `checkpoint` (a folder, a built-in or trained model name) resolved with
    `tokenizer` / `vae`; None for `random:SIZE` and names that are no folder."""
    from ..pipeline.errors import RequestError
    from ..pipeline.policy import checkpoint_root

    layout = getattr(policy, "layout", None)
    if isinstance(layout, CheckpointLayout):
        return layout
    for name in dict.fromkeys((str(getattr(policy, "name", "") or ""), checkpoint)):
        if not name or name.startswith("random:"):
            continue
        try:
            root = checkpoint_root(name)
        except RequestError:  # a trained model that is not present
            continue
        if root.exists():
            return resolve_layout(root, tokenizer=tokenizer, vae=vae)
    return None


def transformer_tensors(layout: CheckpointLayout) -> dict[str, Path]:
    """Tensor name -> shard of the transformer's folder (a `wamrt quantize` artifact's own files included)."""
    return layout.transformer_weights() or weight_files(layout.transformer, required=False) or {}


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


def reasoner_of(policy: Any, checkpoint: str, *, max_len: int = 8192, max_pixels: int | None = None,
                tokenizer: str | Path | None = None, vae: str | Path | None = None) -> tuple[Any | None, str]:
    """The served policy's Reasoner as a chat model (`engine.Reasoner`), or (None, why not). `tokenizer` / `vae`:
    the `--tokenizer` / `--vae` the policy was loaded with, when it does not carry its layout (`served_layout`)."""
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
    try:
        layout = served_layout(policy, checkpoint, tokenizer=tokenizer, vae=vae)
        if layout is None:
            return None, "no checkpoint folder to read lm_head from"
        p = model.embed_tokens.weight
        head = load_lm_head(transformer_tensors(layout), device=p.device, dtype=p.dtype)
        if head is None:
            return None, f"{layout.root}: the checkpoint has no lm_head.weight"
        tower, vision = layout.vision_encoder, None
        if tower is not None and (tower / "config.json").is_file() and model.config.gated_mlp:
            shards = sorted(set(layout.vision_encoder_weights().values())) or None
            vision = VisionTower.from_folder(tower, shards, device=p.device, dtype=p.dtype, max_pixels=max_pixels)
    except CheckpointError as e:
        return None, str(e)
    return Reasoner(ReasonerLM(model, head), hf_tok, vision, max_len=max_len, name=str(layout.root)), "ok"
