"""Full-size models with random weights, built directly on the GPU (speed does not depend on values)."""

from __future__ import annotations

import hashlib
import math
import re

import torch
from diffusers import AutoencoderKLWan

from ..model import Cosmos3Transformer, get_config, init_random_
from .builtin import TINY_VAE
from .tokens import SpecialTokens, TokenizedCaption
from .vae import WAN22_LATENT_MEAN, WAN22_LATENT_STD

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


# BPE-like pre-tokenization (GPT-2 / Qwen style): a word with its leading space, single digits, punctuation runs.
_PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


class VariableLengthTokenizer:
    """Stand-in for the checkpoint tokenizer whose token count follows the text, as a BPE tokenizer's does:
    a fixed chat template around the caption, one token per word piece (words split every 6 letters, one
    token per digit or punctuation run). Ids hash the pieces, so equal texts give equal ids and a shared
    text prefix gives a shared id prefix. With the defaults the built-in sample instruction's DROID caption
    has 125 tokens and the empty (uncond) caption 30: performance.md's counts. What `wamrt serve` uses for
    `random:SIZE`, so lanes with different instructions send different prefix lengths (issue 13)."""

    def __init__(self, vocab: int, template_len: int = 28, word_piece: int = 6) -> None:
        if vocab <= 4:
            raise ValueError(f"vocab must be > 4 (ids 0-3 are special), got {vocab}")
        self.vocab, self.word_piece = vocab, word_piece
        self.special = SpecialTokens(eos_id=1, vision_start_id=2, vision_end_id=3)
        # The template splits around the caption like a chat template: a header before, a footer after.
        head = [self._id(f"<template {i}>") for i in range(template_len)]
        self.head, self.tail = tuple(head[: template_len - 4]), tuple(head[template_len - 4:])

    def _id(self, piece: str) -> int:
        digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
        return 4 + int.from_bytes(digest, "little") % (self.vocab - 4)

    def pieces(self, caption: str) -> list[str]:
        out: list[str] = []
        for piece in _PIECES.findall(caption):
            word = piece.lstrip(" ")
            if word.isalpha() and len(word) > self.word_piece:
                lead = piece[: len(piece) - len(word)]
                parts = [word[i: i + self.word_piece] for i in range(0, len(word), self.word_piece)]
                out.extend([lead + parts[0], *parts[1:]])
            else:
                out.append(piece)
        return out

    def encode(self, caption: str, system_prompt: str | None = None) -> TokenizedCaption:
        text = caption if system_prompt is None else f"{system_prompt}\n{caption}"
        ids = (*self.head, *(self._id(p) for p in self.pieces(text)), *self.tail)
        return TokenizedCaption(caption, ids, (*ids, 1, 2))


TOKENIZERS = {"fixed": FixedLengthTokenizer, "variable": VariableLengthTokenizer}


def random_tokenizer(kind: str, vocab: int) -> FixedLengthTokenizer | VariableLengthTokenizer:
    """`fixed`: every instruction 125 tokens (the latency workload); `variable`: the count follows the text."""
    if kind not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {kind!r}")
    return TOKENIZERS[kind](vocab)


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


def random_quantized_transformer(size: str, device: torch.device, dtype: torch.dtype, recipe: str, *,
                                 seed: int = 0) -> Cosmos3Transformer:
    """A random model at `size` quantized by `recipe` (`random:SIZE@RECIPE`), built one module at a time: each
    quantized linear from a random `dtype` matrix of its own (the only full-precision copy alive), so the device
    never holds more than the quantized model and one matrix (Nano gen-fp8+reasoner-w8: 14.2 GiB, where the bf16
    model it would otherwise be quantized from is 27.1). Values are drawn as `init_random_` draws them (not the same
    stream: `random:SIZE` and `random:SIZE@RECIPE` are different random models)."""
    from ..model.checkpoint import FP32_PREFIXES, random_value
    from ..quant.fp8 import Fp8Linear
    from ..quant.swap import QUANTIZED_TYPES, quantize_model

    with torch.device("meta"):
        model = Cosmos3Transformer(get_config(size))
    quantize_model(model, recipe)  # on the meta device: the recipe's module structure
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, QUANTIZED_TYPES):
                linear = torch.nn.Linear(module.in_features, module.out_features, module.bias is not None,
                                         device=device, dtype=dtype)
                for pname, p in linear.named_parameters():
                    p.copy_(random_value(model, f"{name}.{pname}", p.shape, gen, device).to(dtype))
                owner_name, _, attr = name.rpartition(".")
                quantized = (Fp8Linear.from_linear(linear, kernel=module.kernel) if isinstance(module, Fp8Linear)
                             else type(module).from_linear(linear))
                setattr(model.get_submodule(owner_name) if owner_name else model, attr, quantized)
            elif any(p.is_meta for p in module.parameters(recurse=False)):
                module.to_empty(device=device, recurse=False)
                for pname, p in module.named_parameters(recurse=False):
                    full = f"{name}.{pname}" if name else pname
                    value = random_value(model, full, p.shape, gen, device)
                    p.data = value if full.startswith(FP32_PREFIXES) else value.to(dtype)
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
