"""A tiny diffusers `Cosmos3AVAEAudioTokenizer` (decoder only) with seeded random weights."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

from wamrt.pipeline.builtin import random_sound_tokenizer

# 1600 Hz and a hop of 4 * 16 = 64 samples give the real 25 latent frames per second at a toy size.
TINY_SOUND = dict(sampling_rate=1600, vocoder_input_dim=8, dec_dim=8, dec_c_mults=(1, 2), dec_strides=(4, 16),
                  dec_out_channels=2, encoder_enabled=False)


def tiny_sound_tokenizer(seed: int, sound_dim: int = 8) -> Cosmos3AVAEAudioTokenizer:
    return random_sound_tokenizer({**TINY_SOUND, "vocoder_input_dim": sound_dim}, seed)
