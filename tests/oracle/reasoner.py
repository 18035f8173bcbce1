"""A tiny Reasoner (our tiny-qwen transformer + lm_head + a tiny Qwen3-VL vision tower written by transformers'
`save_pretrained`) and its oracle: transformers' `Qwen3VLForConditionalGeneration` with the same weights, mapped by
`wamrt.reasoner.keys` (the issue's key mapping)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLVisionConfig, Qwen3VLVisionModel

from wamrt.model import Cosmos3Transformer, get_config, init_random_
from wamrt.pipeline.builtin import write_tokenizer
from wamrt.reasoner.builtin import TINY_PROCESSOR, TINY_VISION
from wamrt.reasoner.engine import Reasoner
from wamrt.reasoner.keys import qwen3vl_config, qwen3vl_state_dict
from wamrt.reasoner.lm import ReasonerLM
from wamrt.reasoner.prompt import special_ids
from wamrt.reasoner.vision import VisionTower


@dataclass
class TinyReasoner:
    reasoner: Reasoner
    oracle: Any  # Qwen3VLForConditionalGeneration
    tokenizer: Any
    token_ids: dict[str, int]


def build_tiny_reasoner(folder: Path, *, seed: int = 5, vision: bool = True) -> TinyReasoner:
    cfg = get_config("tiny-qwen")
    transformer = init_random_(Cosmos3Transformer(cfg), seed=seed).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed + 1)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).requires_grad_(False)
    head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / math.sqrt(cfg.hidden_size))
    write_tokenizer(folder / "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    ids = special_ids(tok)
    token_ids = {"image_token_id": ids["image"], "video_token_id": ids["video"],
                 "vision_start_token_id": ids["vision_start"], "vision_end_token_id": ids["vision_end"]}
    vision_cfg = dict(TINY_VISION, out_hidden_size=cfg.hidden_size)
    tower = None
    vision_state = None
    if vision:
        with torch.random.fork_rng():
            torch.manual_seed(seed + 2)
            written = Qwen3VLVisionModel(Qwen3VLVisionConfig(**vision_cfg)).eval()
            # Default init leaves norms at 1 and biases at 0: randomise them too, so they are tested.
            with torch.no_grad():
                for p in written.parameters():
                    if p.ndim == 1:
                        p.add_(0.1 * torch.randn_like(p))
        written.save_pretrained(str(folder / "vision_encoder"))
        tower = VisionTower.from_folder(folder / "vision_encoder", image_processor=TINY_PROCESSOR,
                                        video_processor={"size": TINY_PROCESSOR["size"]})
        vision_state = tower.model.state_dict()
    lm = ReasonerLM(transformer, head)
    reasoner = Reasoner(lm, tok, tower, max_len=512)
    oracle = Qwen3VLForConditionalGeneration(qwen3vl_config(cfg, cfg.vocab_size, vision_cfg, token_ids)).eval()
    state = qwen3vl_state_dict(transformer.state_dict(), head.weight, vision_state)
    if vision_state is None:
        state.update({"model.visual." + k: v for k, v in oracle.model.visual.state_dict().items()})
    oracle.load_state_dict(state, strict=True)
    return TinyReasoner(reasoner, oracle.requires_grad_(False), tok, token_ids)
