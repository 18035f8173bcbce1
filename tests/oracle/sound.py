"""A tiny diffusers `Cosmos3AVAEAudioTokenizer` (decoder only) with seeded random weights."""

from __future__ import annotations

import math

import torch
from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

# 1600 Hz and a hop of 4 * 16 = 64 samples give the real 25 latent frames per second at a toy size.
TINY_SOUND = dict(sampling_rate=1600, vocoder_input_dim=8, dec_dim=8, dec_c_mults=(1, 2), dec_strides=(4, 16),
                  dec_out_channels=2, encoder_enabled=False)


def tiny_sound_tokenizer(seed: int, sound_dim: int = 8) -> Cosmos3AVAEAudioTokenizer:
    tok = Cosmos3AVAEAudioTokenizer(**{**TINY_SOUND, "vocoder_input_dim": sound_dim}).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tok.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("alpha", "beta")):  # log-scale Snake parameters
                p.copy_(0.2 * noise)
            elif name.endswith("weight_g"):
                p.copy_(0.7 + 0.05 * noise)
            elif name.endswith("weight_v"):
                p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.05 * noise)
    return tok
