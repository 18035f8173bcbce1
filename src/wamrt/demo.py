"""The smallest end-to-end run: write a random tiny checkpoint, load it, run the split forward."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from .model import (
    Cosmos3Transformer,
    GeneratorTokens,
    action_positions,
    generator_offset,
    get_config,
    init_random_,
    load_transformer,
    save_transformer,
    text_positions,
    vision_positions,
)


def run_demo(size: str = "tiny-qwen", device: str = "cpu", seed: int = 0) -> int:
    cfg = get_config(size)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = save_transformer(init_random_(Cosmos3Transformer(cfg), seed), Path(tmp), max_shard_bytes=1 << 20)
        t1 = time.perf_counter()
        model = load_transformer(folder, device=device, dtype=torch.float32)
        t2 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    # A DROID-like policy request at reduced size: 9 latent frames of 8x10 patches, 32 action rows.
    text_len, frames, lh, lw, rows, fps = 24, 9, 16, 19, 32, 15.0
    ids = torch.randint(0, cfg.vocab_size, (1, text_len), generator=g)
    off = generator_offset(cfg, text_len)
    pos = torch.cat([text_positions(text_len), vision_positions(cfg, frames, 8, 10, off, fps),
                     action_positions(cfg, rows, off, fps, start_frame=1)], dim=1)[None].to(device)
    tok = GeneratorTokens(
        timesteps=torch.tensor([999.0], device=device),
        vision=torch.randn(1, cfg.latent_channel, frames, lh, lw, generator=g).to(device),
        vision_noisy=(torch.arange(frames) > 0)[None].to(device),
        action=torch.randn(1, rows, cfg.action_dim, generator=g).to(device),
        action_noisy=torch.ones(1, rows, dtype=torch.bool, device=device),
        domain_ids=torch.tensor([8], device=device),
    )
    with torch.inference_mode():
        rope_und, rope_gen = model.rope(pos).split(text_len)
        t3 = time.perf_counter()
        kv = model.prefill_reasoner(ids.to(device), rope_und)
        t4 = time.perf_counter()
        out = model.generator_step(tok, rope_gen, kv)
        t5 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {size}: {n_params / 1e6:.2f} M parameters, {cfg.num_hidden_layers} layers, {cfg.hidden_act}")
    print(f"checkpoint: wrote {t1 - t0:.2f}s, loaded {t2 - t1:.2f}s (sharded safetensors, meta-device build)")
    print(f"request: {text_len} Reasoner tokens, {pos.shape[-1] - text_len} Generator tokens")
    print(f"reasoner prefill {1e3 * (t4 - t3):.1f} ms -> K/V for {len(kv.keys)} layers, "
          f"each {list(kv.keys[0].shape)}")
    print(f"generator step   {1e3 * (t5 - t4):.1f} ms -> vision velocity {list(out.vision.shape)}, "
          f"action velocity {list(out.action.shape)}")
    print(f"action velocity row 0: {[round(x, 3) for x in out.action[0, 0, :8].tolist()]}")
    print(f"clean frame 0 velocity is zero: {bool((out.vision[:, :, 0] == 0).all())}")
    return 0
