"""Token embeddings of the Generator stream: timestep MLP, vision patches, per-embodiment action heads."""

from __future__ import annotations

import math

import torch
from torch import nn


def timestep_features(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """t [N] (already scaled) -> [N, dim] sinusoid laid out as [cos | sin], fp32."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    angles = t[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


class TimestepMLP(nn.Module):
    """Linear -> SiLU -> Linear on the timestep sinusoid. Kept in fp32 whatever the model dtype."""

    def __init__(self, in_dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(nn.functional.silu(self.linear_1(features)))


class DomainLinear(nn.Module):
    """One affine map per embodiment domain; weights stored input-major as [domains, in*out].

    The storage (two embedding tables named `fc` and `bias`) is the checkpoint's; the math is a
    batched matmul with one weight matrix per sequence.
    """

    def __init__(self, in_features: int, out_features: int, num_domains: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.num_domains = in_features, out_features, num_domains
        self.fc = nn.Embedding(num_domains, in_features * out_features)
        self.bias = nn.Embedding(num_domains, out_features)

    def forward(self, x: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """x [B, T, in], domain_ids [B] (long, validated by the caller) -> [B, T, out]."""
        weight = self.fc.weight[domain_ids].view(-1, self.in_features, self.out_features)
        return torch.bmm(x, weight) + self.bias.weight[domain_ids][:, None, :]


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, T*ceil(H/p)*ceil(W/p), p*p*C]; odd H/W are zero-padded.

    Token order is frame, patch row, patch column; a token's vector is ordered (row-in-patch,
    col-in-patch, channel), as the checkpoints were trained.
    """
    b, c, t, h, w = latents.shape
    ph, pw = -(-h // p), -(-w // p)
    if (ph * p, pw * p) != (h, w):
        latents = nn.functional.pad(latents, (0, pw * p - w, 0, ph * p - h))
    x = latents.reshape(b, c, t, ph, p, pw, p).permute(0, 2, 3, 5, 4, 6, 1)  # [B, T, ph, pw, p, p, C]
    return x.reshape(b, t * ph * pw, p * p * c)


def unpatchify(tokens: torch.Tensor, t: int, h: int, w: int, p: int) -> torch.Tensor:
    """Inverse of `patchify`: [B, T*ph*pw, p*p*C] -> [B, C, T, H, W] (padding cropped)."""
    b, _, dim = tokens.shape
    c = dim // (p * p)
    ph, pw = -(-h // p), -(-w // p)
    x = tokens.reshape(b, t, ph, pw, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)  # [B, C, T, ph, p, pw, p]
    return x.reshape(b, c, t, ph * p, pw * p)[..., :h, :w]
