"""3-D MRoPE position ids for the packed Cosmos 3 sequence [text | vision | sound | action].

Rows are (t, h, w), float32. Text token i sits at (i, i, i). Every Generator modality starts at the
same temporal offset O = text_len + margin (they are temporal siblings); with fps modulation the
temporal index of frame f is (f + start) / (fps / compression) * (base_fps / base_compression) + O.
"""

from __future__ import annotations

import torch

from .config import Cosmos3Config

VAE_TEMPORAL_COMPRESSION = 4  # Wan2.2: 4 pixel frames per latent frame


def text_positions(num_tokens: int, device: torch.device | None = None) -> torch.Tensor:
    ids = torch.arange(num_tokens, dtype=torch.float32, device=device)
    return ids.unsqueeze(0).expand(3, -1).contiguous()  # [3, n]


def generator_offset(cfg: Cosmos3Config, text_len: int) -> int:
    """Temporal index of the first Generator token: the AR -> diffusion margin after the text."""
    return text_len + cfg.unified_3d_mrope_temporal_modality_margin


def grid_positions(
    grid_t: int,
    grid_h: int,
    grid_w: int,
    *,
    offset: int,
    fps: float | None,
    base_fps: float,
    compression: int,
    base_compression: int,
    start_frame: int = 0,
    reset_spatial: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Positions of a (t, h, w) token grid in frame-major order -> [3, t*h*w] float32.

    A single frame (grid_t == 1) or fps=None uses integer temporal steps, as the checkpoints do.
    """
    if fps is not None and grid_t > 1:
        frames = torch.arange(grid_t, dtype=torch.float32, device=device)
        t = (frames + start_frame) / (fps / compression) * (base_fps / base_compression) + offset
    else:
        t = (torch.arange(grid_t, dtype=torch.int64, device=device) + int(offset) + start_frame).float()
    t = t.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h, device=device).view(1, -1, 1).expand(grid_t, -1, grid_w).flatten()
    w = torch.arange(grid_w, device=device).view(1, 1, -1).expand(grid_t, grid_h, -1).flatten()
    if not reset_spatial:
        h, w = h + int(offset), w + int(offset)
    return torch.stack((t, h.float(), w.float()))


def vision_positions(
    cfg: Cosmos3Config, t: int, ph: int, pw: int, offset: int, fps: float, device: torch.device | None = None
) -> torch.Tensor:
    """Vision latent patches (t frames of ph x pw patches)."""
    return grid_positions(
        t, ph, pw, offset=offset, fps=fps if cfg.enable_fps_modulation else None,
        base_fps=float(cfg.base_fps), compression=VAE_TEMPORAL_COMPRESSION,
        base_compression=VAE_TEMPORAL_COMPRESSION, reset_spatial=cfg.unified_3d_mrope_reset_spatial_ids,
        device=device,
    )


def action_positions(
    cfg: Cosmos3Config,
    rows: int,
    offset: int,
    fps: float,
    *,
    start_frame: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Action rows in latent-frame time units. start_frame=1 (diffusers) puts row k at the pixel
    frame it leads to; start_frame=0 (the framework's DROID server, whose row 0 is the state) at k."""
    return grid_positions(
        rows, 1, 1, offset=offset, fps=fps if cfg.enable_fps_modulation else None,
        base_fps=float(cfg.base_fps), compression=1, base_compression=VAE_TEMPORAL_COMPRESSION,
        start_frame=start_frame, reset_spatial=cfg.unified_3d_mrope_reset_spatial_ids, device=device,
    )


def sound_positions(
    cfg: Cosmos3Config, frames: int, offset: int, fps: float, device: torch.device | None = None
) -> torch.Tensor:
    """Sound latent frames; the reference uses base_fps without the /4, so a different time unit."""
    return grid_positions(
        frames, 1, 1, offset=offset, fps=fps if cfg.enable_fps_modulation else None,
        base_fps=float(cfg.base_fps), compression=1, base_compression=1,
        reset_spatial=cfg.unified_3d_mrope_reset_spatial_ids, device=device,
    )
