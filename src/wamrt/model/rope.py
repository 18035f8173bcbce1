"""Interleaved 3-D multimodal RoPE (Qwen3-VL style) with float (fps-modulated) positions."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rope(NamedTuple):
    """cos/sin tables in the model dtype, one row per token: [B, N, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor

    def split(self, at: int) -> tuple[Rope, Rope]:
        return (
            Rope(self.cos[:, :at], self.sin[:, :at]),
            Rope(self.cos[:, at:], self.sin[:, at:]),
        )


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    # Same expression order as the reference so fp32 values agree bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)  # [head_dim/2]


def mrope_tables(
    positions: torch.Tensor,
    *,
    head_dim: int,
    theta: float,
    axes: tuple[int, int, int],
    dtype: torch.dtype,
) -> Rope:
    """positions [B, 3, N] (rows t, h, w; float32) -> Rope with [B, N, head_dim] tables.

    Frequency j takes its angle from the h row when j % 3 == 1 and j < 3*axes[1], from the w row
    when j % 3 == 2 and j < 3*axes[2], and from the t row otherwise. Angles are formed in fp32
    (positions above 15000 would collapse in bf16).
    """
    if positions.ndim != 3 or positions.shape[1] != 3:
        raise ValueError(f"positions must be [B, 3, N], got {tuple(positions.shape)}")
    inv = inverse_frequencies(head_dim, theta, positions.device)
    with torch.autocast(device_type=positions.device.type, enabled=False):
        angles = positions.float()[..., None] * inv  # [B, 3, N, d/2]
    freqs = angles[:, 0].clone()  # [B, N, d/2]
    freqs[..., 1 : 3 * axes[1] : 3] = angles[:, 1, :, 1 : 3 * axes[1] : 3]
    freqs[..., 2 : 3 * axes[2] : 3] = angles[:, 2, :, 2 : 3 * axes[2] : 3]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, N, d]
    return Rope(emb.cos().to(dtype), emb.sin().to(dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [B, S, heads, d] rotated with tables [B, S, d] (rotate-half convention)."""
    cos = rope.cos.unsqueeze(2)
    sin = rope.sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin
