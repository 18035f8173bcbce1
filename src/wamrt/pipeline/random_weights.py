"""Full-size models with random weights, built directly on the GPU (speed does not depend on values)."""

from __future__ import annotations

import hashlib
import math

import torch
from diffusers import AutoencoderKLWan

from ..model import Cosmos3Transformer, get_config, init_random_
from .builtin import TINY_VAE
from .denoise import SamplingOptions
from .droid import DroidContract
from .policy import Policy
from .tokens import SpecialTokens, TokenizedCaption
from .vae import WAN22_LATENT_MEAN, WAN22_LATENT_STD, FrameEncoder

# Wan2.2 TI2V-5B VAE layout (the real encoder's size; decoder unused by policies).
WAN22_VAE = dict(TINY_VAE, base_dim=160, decoder_base_dim=256, num_res_blocks=2)


class FixedLengthTokenizer:
    """Stand-in for the checkpoint tokenizer with the token counts of performance.md's workload
    (cond 125, uncond 30): ids derived from the caption bytes, so equal captions give equal ids."""

    def __init__(self, vocab: int, cond_len: int = 125, uncond_len: int = 30) -> None:
        self.vocab, self.cond_len, self.uncond_len = vocab, cond_len, uncond_len
        self.special = SpecialTokens(eos_id=1, vision_start_id=2, vision_end_id=3)

    def encode(self, caption: str, system_prompt: str | None = None) -> TokenizedCaption:
        n = (self.cond_len if caption else self.uncond_len) - 2
        digest = hashlib.sha256(caption.encode()).digest()
        ids = tuple(4 + (digest[i % 32] * 131 + i * 7919) % (self.vocab - 4) for i in range(n))
        return TokenizedCaption(caption, ids, (*ids, 1, 2))


def random_transformer(size: str, device: torch.device, dtype: torch.dtype, *, layers: int | None = None,
                       seed: int = 0) -> Cosmos3Transformer:
    cfg = get_config(size)
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
    model = model.to_empty(device=device)
    init_random_(model, seed)
    model.to(dtype)
    model.time_embedder.to(torch.float32)
    return model.eval().requires_grad_(False)


def random_vae(device: torch.device, dtype: torch.dtype, *, tiny: bool = False, seed: int = 1) -> AutoencoderKLWan:
    cfg = dict(TINY_VAE if tiny else WAN22_VAE, latents_mean=list(WAN22_LATENT_MEAN),
               latents_std=list(WAN22_LATENT_STD))
    with torch.device("meta"):
        vae = AutoencoderKLWan(**cfg)
    vae = torch.nn.Module.to_empty(vae, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(math.prod(p.shape[1:])), generator=gen)
    return torch.nn.Module.to(vae, dtype=dtype).eval().requires_grad_(False)


def random_policy(size: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, *,
                  layers: int | None = None, tiny_vae: bool = False, prompt_format: str = "plain") -> Policy:
    dev = torch.device(device)
    model = random_transformer(size, dev, dtype, layers=layers)
    encoder = FrameEncoder(random_vae(dev, dtype, tiny=tiny_vae))
    tok = FixedLengthTokenizer(model.config.vocab_size)
    return Policy(model, encoder, tok, DroidContract(prompt_format=prompt_format),  # type: ignore[arg-type]
                  SamplingOptions(), name=f"{size} (random weights)")
