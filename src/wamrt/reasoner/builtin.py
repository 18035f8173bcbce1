"""The Reasoner parts of the built-in tiny models: an `lm_head` in the transformer's safetensors (where diffusers'
`Cosmos3OmniTransformer.save_pretrained` keeps it) and, for `tiny-world`, a tiny Qwen3-VL vision tower written by
transformers' own `save_pretrained`, in the hub layout (vision_encoder/ plus a root `model.safetensors.index.json`
whose weight map points into transformer/ and vision_encoder/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..pipeline.layout import ROOT_INDEX

# A tiny tower of the Nano / Super layout (patch 16, temporal patch 2, spatial merge 2, DeepStack features).
TINY_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
# At most 64 merged tokens per image / frame pair: CPU-sized prompts.
TINY_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 4096, "longest_edge": 65536}}


def add_lm_head(transformer_dir: Path, seed: int) -> None:
    """Add a seeded random `lm_head.weight` [vocab, hidden] to the folder's single safetensors file."""
    files = sorted(transformer_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{transformer_dir}: expected one safetensors file, found {len(files)}")
    with safe_open(str(files[0]), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    vocab, hidden = state["embed_tokens.weight"].shape
    gen = torch.Generator().manual_seed(seed)
    state["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)
    save_file(state, str(files[0]), metadata={"format": "pt"})


def add_vision_encoder(root: Path, out_hidden: int, seed: int) -> None:
    from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tower = Qwen3VLVisionModel(Qwen3VLVisionConfig(**TINY_VISION, out_hidden_size=out_hidden)).eval()
    tower.save_pretrained(str(root / "vision_encoder"))
    (root / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", **TINY_PROCESSOR}, indent=2))
    write_root_index(root)


def write_root_index(root: Path) -> None:
    """The hub's root index: every tensor of transformer/ and vision_encoder/, by the file that holds it."""
    weight_map: dict[str, str] = {}
    for sub in ("transformer", "vision_encoder"):
        for file in sorted((root / sub).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                weight_map.update({k: f"{sub}/{file.name}" for k in f.keys()})
    (root / ROOT_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
