"""Checkpoint folders as users have them, written by the libraries that write them (no hand-made layouts):

* `save_diffusers_pipeline`: a tiny random `Cosmos3OmniPipeline` through diffusers' own `save_pretrained`
  (model_index.json, transformer/, vae/, text_tokenizer/, scheduler/), every component sharded;
* `to_hub_layout`: that folder turned into the hub repository NVIDIA's converter publishes: its root config.json
  (the framework's, not the transformer's), the tokenizer files at the root, a Qwen3-VL vision tower saved by
  transformers' `save_pretrained` under vision_encoder/, and a root model.safetensors.index.json built from the
  shards' headers (as the converter's `SafetensorsIndex.update_dir` builds it).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from wamrt.model import get_config
from wamrt.pipeline.builtin import TINY_VAE, write_tokenizer
from wamrt.pipeline.vae import WAN22_LATENT_MEAN, WAN22_LATENT_STD

from .scheduler import reference_unipc
from .transformer import build_reference


def save_diffusers_pipeline(out: Path, *, flavour: str = "tiny-qwen", shift: float = 7.0, seed: int = 3,
                            max_shard_size: str = "300KB") -> Path:
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline
    from transformers import AutoTokenizer

    transformer = build_reference(get_config(flavour).replace(vocab_size=512), seed=seed)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**TINY_VAE, latents_mean=list(WAN22_LATENT_MEAN), latents_std=list(WAN22_LATENT_STD))
    write_tokenizer(out.parent / f".{out.name}-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(out.parent / f".{out.name}-tokenizer"), local_files_only=True)
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae,
                               scheduler=reference_unipc(shift), enable_safety_checker=False)
    pipe.save_pretrained(str(out), max_shard_size=max_shard_size)
    shutil.rmtree(out.parent / f".{out.name}-tokenizer")
    return out


def _header_keys(shard: Path) -> list[str]:
    with shard.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return [k for k in json.loads(f.read(size)) if k != "__metadata__"]


def to_hub_layout(folder: Path, *, keep_transformer_index: bool = False) -> Path:
    """In place. Without `keep_transformer_index` the transformer's own index is removed, so that the root index
    is the only map of its shards (what NVIDIA's loader reads)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionConfig, Qwen3VLVisionModel

    vision = Qwen3VLVisionModel(Qwen3VLVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                    out_hidden_size=64, num_position_embeddings=16,
                                                    deepstack_visual_indexes=[]))
    vision.save_pretrained(str(folder / "vision_encoder"))
    for item in (folder / "text_tokenizer").iterdir():  # the converter copies the VLM's tokenizer files to the root
        shutil.copy(item, folder / item.name)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Cosmos3ForConditionalGeneration"], "model_type": "cosmos3_omni",
        "allow_patterns_overrides": ["*/*.safetensors"], "model": {"config": {"action_gen": True}},
    }, indent=2))
    weight_map: dict[str, str] = {}
    for sub in ("transformer", "vision_encoder"):
        for shard in sorted((folder / sub).glob("*.safetensors")):
            weight_map.update({k: f"{sub}/{shard.name}" for k in _header_keys(shard)})
    total = sum(p.stat().st_size for p in folder.glob("*/*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if not keep_transformer_index:
        for index in (folder / "transformer").glob("*.safetensors.index.json"):
            index.unlink()
    return folder
