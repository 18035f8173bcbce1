"""What a training sample gets drawn per step: its noise level, its clean action prefix (right or perturbed) and
its image augmentation. Pure tensor functions of a seeded generator, apart from `PolicyTrainer` so each can be
tested alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_prefix_rows(n: int, max_rows: int, zero_share: float, gen: torch.Generator,
                       device: torch.device) -> torch.Tensor:
    """[n] long prefix lengths: 0 with probability zero_share, else uniform in 1..max_rows."""
    d = torch.randint(1, max_rows + 1, (n,), generator=gen, device=device)
    none = torch.rand(n, generator=gen, device=device) < zero_share
    return torch.where(none, torch.zeros_like(d), d)


def perturb_prefix(a0: torch.Tensor, prefix_rows: torch.Tensor, history: int, joints: int, scale: float,
                   return_rows: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(model input, training target) [B, rows, A] from the clean chunk a0 (model space): each sample with a prefix
    draws one offset z ~ N(0, scale²) on its `joints` columns; its d prefix rows (after the state rows) hold a0 + z,
    and the rows after them are to go from there back to a0: target a0 + z·exp(−(k + 1) / return_rows) k rows
    after the prefix (return_rows 0: a0, a jump the runner's seam then smooths). The state rows never move."""
    b, rows, width = a0.shape
    r = torch.arange(rows, device=a0.device)[None]  # [1, rows]
    end = history + prefix_rows[:, None]  # [B, 1]: the first row after the prefix
    z = scale * torch.randn(b, 1, width, generator=gen, device=a0.device)
    z = z * (torch.arange(width, device=a0.device) < joints) * (prefix_rows > 0).view(b, 1, 1)
    in_prefix = ((r >= history) & (r < end))[..., None]
    a_in = a0 + z * in_prefix
    if return_rows <= 0:
        return a_in, a0
    after = (r - end).clamp(min=0).to(a0.dtype)
    back = torch.where(r >= end, torch.exp(-(after + 1) / return_rows), torch.zeros_like(after))[..., None]
    return a_in, a0 + z * back


def prefix_action_noisy(prefix_rows: torch.Tensor, rows: int, history: int) -> torch.Tensor:
    """[B, rows] bool: the rows a sample generates -- all but its state row(s) and its d clean prefix rows (what a
    served request with `action_prefix` in clean mode marks; `droid._action_noisy(rows, history + d)`)."""
    return torch.arange(rows, device=prefix_rows.device)[None] >= history + prefix_rows[:, None]


def sample_sigmas(n: int, shift: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    u = torch.rand(n, generator=gen, device=device).clamp(1e-4, 1 - 1e-4)
    return shift * u / (1 + (shift - 1) * u)


def augment(pixels: torch.Tensor, gen: torch.Generator, shift_px: int, colour: float) -> torch.Tensor:
    """pixels float [B, F, 3, H, W] in [0, 255]; one random transform per sample, shared by its F frames."""
    b, f, c, h, w = pixels.shape
    dev = pixels.device
    if shift_px > 0:
        d = torch.randint(-shift_px, shift_px + 1, (2, b), generator=gen, device=dev)
        theta = torch.zeros(b, 2, 3, device=dev)
        theta[:, 0, 0] = theta[:, 1, 1] = 1.0
        theta[:, 0, 2] = 2.0 * d[0] / w
        theta[:, 1, 2] = 2.0 * d[1] / h
        grid = F.affine_grid(theta, [b, c, h, w], align_corners=False)
        grid = grid.repeat_interleave(f, dim=0)
        pixels = F.grid_sample(pixels.reshape(b * f, c, h, w), grid, mode="nearest", padding_mode="border",
                               align_corners=False).reshape(b, f, c, h, w)
    if colour > 0:
        r = lambda *s: (torch.rand(*s, generator=gen, device=dev) * 2 - 1) * colour  # noqa: E731
        bright = 1 + r(b, 1, 1, 1, 1)
        gain = 1 + 0.5 * r(b, 1, 3, 1, 1)
        contrast = 1 + r(b, 1, 1, 1, 1)
        mean = pixels.mean(dim=(2, 3, 4), keepdim=True)
        pixels = ((pixels - mean) * contrast + mean) * bright * gain
    return pixels.clamp(0, 255)
