"""Tiny random Cosmos 3 models and one policy-shaped request for the quantization tests (CPU, fp32)."""

from __future__ import annotations

import torch

from wamrt.model import (
    Cosmos3Transformer,
    GeneratorTokens,
    action_positions,
    generator_offset,
    get_config,
    init_random_,
    text_positions,
    vision_positions,
)


def tiny_model(name: str = "tiny-qwen", seed: int = 3, dtype: torch.dtype = torch.float32
               ) -> Cosmos3Transformer:
    model = init_random_(Cosmos3Transformer(get_config(name)).eval().requires_grad_(False), seed=seed)
    return model.to(dtype)


def policy_inputs(model: Cosmos3Transformer, seed: int = 0, *, text: int = 11, frames: int = 3, hw=(6, 8),
                  rows: int = 8) -> tuple[torch.Tensor, torch.Tensor, GeneratorTokens]:
    """A DROID-like request: frame 0 clean, later frames and every action row noisy."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    off = generator_offset(cfg, text)
    ph, pw = -(-hw[0] // 2), -(-hw[1] // 2)
    pos = torch.cat([text_positions(text), vision_positions(cfg, frames, ph, pw, off, 15.0),
                     action_positions(cfg, rows, off, 15.0, start_frame=1)], dim=1)
    tok = GeneratorTokens(
        timesteps=torch.tensor([700.0]),
        vision=torch.randn(1, cfg.latent_channel, frames, *hw, generator=g),
        vision_noisy=torch.tensor([[f > 0 for f in range(frames)]]),
        action=torch.randn(1, rows, cfg.action_dim, generator=g),
        action_noisy=torch.ones(1, rows, dtype=torch.bool),
        domain_ids=torch.tensor([int(torch.randint(0, cfg.num_embodiment_domains, (1,), generator=g))]),
    )
    ids = torch.randint(0, cfg.vocab_size, (1, text), generator=g)
    return ids, pos[None], tok


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
