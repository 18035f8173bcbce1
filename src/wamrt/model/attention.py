"""Attention math used by the model. Engines may substitute a faster function with the same contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, Sq, d], k/v [B, K, Sk, d] (GQA: H a multiple of K), key_mask [B, Sk] bool (True = attend).

    K/V heads are repeated explicitly: SDPA's enable_gqa path falls back to the math kernel on CUDA.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    mask = None
    if key_mask is not None:
        if causal:
            raise ValueError("key_mask with causal attention is not supported")
        mask = key_mask[:, None, None, :]  # [B, 1, 1, Sk]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@dataclass(frozen=True)
class ControlSegments:
    """A transfer sequence's Generator part [ctrl_1 | ... | ctrl_N | target]: N clean control videos of `tokens`
    tokens each, in front of the generated target (and whatever follows it), and each control's weight
    (`weights` [B, N], summing to 1 per row)."""

    count: int
    tokens: int
    weights: torch.Tensor

    @classmethod
    def of(cls, controls: torch.Tensor | None, weights: torch.Tensor | None, patch: int) -> ControlSegments | None:
        """From control latents [B, N, C, T, H, W] and their weights [B, N]; None without controls."""
        if controls is None:
            return None
        if weights is None or weights.shape != controls.shape[:2]:
            raise ValueError(f"control_weights must be [B, N] = {tuple(controls.shape[:2])}, got "
                             f"{None if weights is None else tuple(weights.shape)}")
        _, n, _, t, h, w = controls.shape
        return cls(n, t * (-(-h // patch)) * (-(-w // patch)), weights)


def control_pass_keys(k: torch.Tensor, gen_at: int, i: int, seg: ControlSegments) -> torch.Tensor:
    """The keys (or values, or a key mask: dim 2 or 1 = the sequence) pass i of a multi-control layer attends over:
    everything before the Generator part (`gen_at`: the Reasoner prefix, or nothing when the Generator comes first),
    control i, and everything after the controls (the target, and anything laid out after it)."""
    dim = k.ndim - 2 if k.ndim == 4 else 1
    m, n = seg.tokens, seg.count
    parts = [k.narrow(dim, 0, gen_at), k.narrow(dim, gen_at + i * m, m),
             k.narrow(dim, gen_at + n * m, k.shape[dim] - gen_at - n * m)]
    return torch.cat([p for p in parts if p.shape[dim]], dim=dim)


def control_attention(attn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gen_at: int,
                      seg: ControlSegments, key_mask: torch.Tensor | None = None,
                      control_queries: bool = True) -> torch.Tensor:
    """Attention of a transfer layer with N > 1 controls, as NVIDIA's cosmos-framework defines it: N passes, in pass
    i control i and the target attend to [text | ctrl_i | target]; control i's output is pass i's, the target's is
    the weighted sum of the passes' (`seg.weights`). Controls never see each other; N = 1 is ordinary attention.
    q [B, H, Sq, d]: the Generator queries, controls first (`control_queries`) or the target's only (an engine's
    last layer, whose control rows are never read); k / v [B, K, Sk, d], key_mask [B, Sk] as `attn` takes them."""
    n, m = seg.count, seg.tokens
    target_q = q[:, :, n * m:] if control_queries else q
    controls, target = [], None
    for i in range(n):
        qi = torch.cat([q[:, :, i * m:(i + 1) * m], target_q], dim=2) if control_queries else target_q
        mask = None if key_mask is None else control_pass_keys(key_mask, gen_at, i, seg)
        out = attn(qi, control_pass_keys(k, gen_at, i, seg), control_pass_keys(v, gen_at, i, seg), causal=False,
                   key_mask=mask)
        if control_queries:
            controls.append(out[:, :, :m])
            out = out[:, :, m:]
        weighted = out * seg.weights[:, i].to(out.dtype)[:, None, None, None]
        target = weighted if target is None else target + weighted
    assert target is not None
    return torch.cat([*controls, target], dim=2) if controls else target
