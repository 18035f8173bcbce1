"""The decode step's layers with their small kernels fused by Inductor, for the decode graphs to capture.

A CUDA graph of the eager step still replays ~45 kernels per Reasoner layer one by one (RMSNorms, q/k norms and
RoPE as separate elementwise ops, SiLU and the gate product). On the H200 at Nano a batch-1 step took 9.98 ms
against 3.15 ms of weight reads, and grew only 2.3 ms from batch 1 to 32: the time went to the number of kernels,
not to bytes (bench/results/decode/2026-12-05-602b653-nano/). Here the work before attention (input norm,
projections, q/k norms, RoPE) and after it (output projection, residuals, post-attention norm, MLP) are two
compiled regions, shared by every layer (parameters are graph inputs), compiled once per row count; attention
stays eager, since its key span changes from step to step.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..model import Rope


def _before_attention(layer: Any, u: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The Generator's k_for_gen is not returned, so Inductor drops its work.
    q, k, _k_gen, v = layer.reasoner_pre(u, rope)
    return q, k, v


def _after_attention(layer: Any, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return layer.reasoner_post(u, o)


# Compile modes `wamrt bench decode --fused-modes` compares. At batch 1 a step is GEMVs: "max-autotune-no-cudagraphs"
# lets Inductor time its Triton matmul templates against cuBLAS per shape (the decode graphs do the capturing);
# "coordinate-descent" tunes the generated kernels' launch parameters.
FUSED_MODES = ("default", "max-autotune-no-cudagraphs", "coordinate-descent")


class FusedDecodeLayer:
    """`layer_fn` for `ReasonerLM.decode_step`: `MoTLayer.reasoner_pre` and `reasoner_post` compiled, attention
    eager between them."""

    def __init__(self, mode: str | None = None) -> None:
        if mode not in (None, *FUSED_MODES):
            raise ValueError(f"fused decode mode {mode!r}: one of {', '.join(FUSED_MODES)}")
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if not torch._dynamo.config.inline_inbuilt_nn_modules:  # always on from torch 2.13 (setting it warns)
            torch._dynamo.config.inline_inbuilt_nn_modules = True  # parameters as inputs: one graph, every layer
        if mode == "coordinate-descent":
            compiled = partial(torch.compile, dynamic=False, options={"coordinate_descent_tuning": True})
        else:
            compiled = partial(torch.compile, dynamic=False, mode=None if mode == "default" else mode)
        self.before, self.after = compiled(_before_attention), compiled(_after_attention)

    def __call__(self, layer: Any, u: torch.Tensor, rope: Rope, attention: Any) -> torch.Tensor:
        q, k, v = self.before(layer, u, rope)
        o = attention(q, k, v, causal=True, key_mask=None)
        return self.after(layer, u, o)
