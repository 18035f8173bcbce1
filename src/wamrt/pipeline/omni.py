"""What the task contracts defined by diffusers' `Cosmos3OmniPipeline` share: the action modes
(`generic.py`) and the world-generation modes (`world.py`).

Sampling options, the noise draw, the model/VAE/tokenizer checks, the packed positions of one CFG
branch, and the VAE decode to frames, each as the reference computes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..model import (
    Cosmos3Config,
    Cosmos3Transformer,
    action_positions,
    generator_offset,
    sound_positions,
    text_positions,
    vision_positions,
)
from ..ops.capture_turn import empty_cache
from .denoise import Branch, SamplingOptions
from .errors import RequestError
from .geometry import VAE_SPATIAL, VAE_TEMPORAL, LatentGeometry
from .inputs import finite_number, positive_int
from .tokens import CaptionTokenizer
from .vae import FrameEncoder

log = logging.getLogger(__name__)


def diffusers_sampling(steps: int, guidance: float, shift: float) -> SamplingOptions:
    """The reference's flow-UniPC schedule with CFG combined in fp32."""
    return SamplingOptions(
        steps=positive_int(steps, "steps"),
        guidance=finite_number(guidance, "guidance"),
        shift=finite_number(shift, "shift", positive=True),
        schedule="diffusers",
        cfg_in_model_dtype=False,
    )


def draw_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Drawn on the generator's device (a CPU generator stays reproducible on any accelerator), in fp32.
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where, dtype=torch.float32).to(device)


def model_device(model: Cosmos3Transformer) -> torch.device:
    return next(model.parameters()).device


def check_vae(cfg: Cosmos3Config, encoder: FrameEncoder) -> None:
    if encoder.latent_channels != cfg.latent_channel:
        raise RequestError(
            f"VAE has {encoder.latent_channels} latent channels, the transformer expects {cfg.latent_channel}",
            field="vae",
        )
    if (encoder.spatial, encoder.temporal) != (VAE_SPATIAL, VAE_TEMPORAL):
        raise RequestError(
            f"VAE compression {(encoder.spatial, encoder.temporal)} is not Wan2.2's {(VAE_SPATIAL, VAE_TEMPORAL)}",
            field="vae",
        )


def tokenize_branches(
    tokenizer: CaptionTokenizer, cfg: Cosmos3Config, cond: str, uncond: str, system_prompt: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token ids of the (cond, uncond) captions, both with the same system prompt."""
    cond_ids = tokenizer.encode(cond, system_prompt).text_ids
    uncond_ids = tokenizer.encode(uncond, system_prompt).text_ids
    top = max(max(cond_ids), max(uncond_ids))
    if top >= cfg.vocab_size:
        raise RequestError(f"token id {top} >= vocab_size {cfg.vocab_size}", field="tokenizer")
    return cond_ids, uncond_ids


def packed_branch(
    cfg: Cosmos3Config,
    ids: Sequence[int],
    latent: LatentGeometry,
    fps: float,
    device: torch.device,
    *,
    sound_frames: int = 0,
    action_rows: int = 0,
    controls: int = 0,
) -> Branch:
    """Token ids and positions of one CFG branch packed as [text | vision | sound | action], or for video transfer
    [text | control_1 ... control_N | vision]: every control on the vision's own (t, h, w) grid."""
    u, p = len(ids), cfg.latent_patch_size
    offset = generator_offset(cfg, u)  # vision, sound and action are temporal siblings at one offset
    vision = vision_positions(cfg, latent.latent_t, -(-latent.latent_h // p), -(-latent.latent_w // p), offset, fps)
    parts = [text_positions(u), *[vision] * (controls + 1)]
    if sound_frames:
        parts.append(sound_positions(cfg, sound_frames, offset, float(cfg.sound_latent_fps)))
    if action_rows:
        # start_frame=1: action k sits at the time of the frame it leads to (diffusers' convention).
        parts.append(action_positions(cfg, action_rows, offset, fps, start_frame=1))
    positions = torch.cat(parts, dim=1)  # [3, U + G]
    return Branch(torch.tensor([list(ids)], dtype=torch.long, device=device), positions[None].to(device))


TILED_DECODE_NOTE = "VAE decoded in overlapping tiles: the whole clip did not fit in device memory"


def _decode_fitting(vae, z: torch.Tensor, notes: list[str] | None) -> torch.Tensor:
    """`vae.decode(z)`, or, when that runs out of device memory, diffusers' tiled decode (overlapping spatial tiles
    blended at their seams: not bit-equal to the full decode, hence the note)."""
    try:
        return vae.decode(z).sample
    except torch.OutOfMemoryError:
        if getattr(vae, "use_tiling", True):  # already tiled, or a VAE without tiling: nothing smaller to try
            raise
    vae.clear_cache()  # out of the except block: the failed attempt's frames are released first
    empty_cache()  # not while another thread captures
    log.warning("VAE decode of latents %s ran out of device memory; decoding in tiles", tuple(z.shape))
    vae.enable_tiling()
    try:
        pixels = vae.decode(z).sample
    finally:
        vae.disable_tiling()
    if notes is not None:
        notes.append(TILED_DECODE_NOTE)
    return pixels


@torch.inference_mode()
def decode_pixels(encoder: FrameEncoder, latents: torch.Tensor, *, to_host: bool = True,
                  notes: list[str] | None = None) -> torch.Tensor:
    """Normalised latents [1, C, T, H, W] -> float32 [4(T-1)+1, 16H, 16W, 3] in [0, 1] (the reference's
    output_type="np"), on the host, or left on the VAE's device with `to_host=False`. A clip whose decode does not
    fit in device memory is decoded in tiles, and `notes` (when given) says so."""
    vae = encoder.vae
    z = latents.to(device=vae.device, dtype=vae.dtype) / encoder.inv_std + encoder.mean  # un-normalise
    pixels = _decode_fitting(vae, z, notes).to(torch.float32)  # [1, 3, T', H', W'] in [-1, 1]
    pixels = (pixels[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).contiguous()  # [T', H', W', 3]
    return pixels.cpu() if to_host else pixels


def pixels_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    # round() is half-to-even, like numpy's in the reference's float -> uint8 step.
    return (pixels * 255).round().to(torch.uint8)


def decode_frames(encoder: FrameEncoder, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents [1, C, T, H, W] -> uint8 [4(T-1)+1, 16H, 16W, 3], as the reference's "pil" output."""
    return pixels_to_uint8(decode_pixels(encoder, latents))
