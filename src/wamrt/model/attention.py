"""Attention math used by the model. Engines may substitute a faster function with the same contract."""

from __future__ import annotations

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
