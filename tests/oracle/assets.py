"""What the pipeline parity tests share: the tiny VAE and tokenizer written in diffusers' layout and loaded both
ways (ours and the reference's), and a test picture that makes resizes do real work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer

from wamrt.pipeline.builtin import write_tokenizer, write_vae
from wamrt.pipeline.tokens import CaptionTokenizer
from wamrt.pipeline.vae import FrameEncoder, load_vae


@dataclass
class TinyAssets:
    vae: Any  # diffusers AutoencoderKLWan, shared by our encoder and the reference pipeline
    hf_tokenizer: Any
    encoder: FrameEncoder
    tokenizer: CaptionTokenizer


def tiny_assets(root: Path, vae_seed: int = 11) -> TinyAssets:
    write_vae(root / "vae", seed=vae_seed)
    write_tokenizer(root / "tokenizer")
    vae = load_vae(root / "vae", dtype=torch.float32)
    hf = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    return TinyAssets(vae, hf, FrameEncoder(vae), CaptionTokenizer(hf))


def picture(h: int, w: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: bilinear / bicubic resizes then do real work on every pixel."""
    rs = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([255 * yy / h, 255 * xx / w, 128 + 60 * np.sin((xx + yy) / 5)], axis=-1)
    return Image.fromarray(np.clip(base + rs.randint(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8))
