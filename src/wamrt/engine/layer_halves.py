"""The Generator layer's two halves around attention, as the engine compiles them (regional compile: one compiled
graph per half, re-used by every layer) and captures them. Plain functions of (layer, tensors), so the gen-fp8
(`fp8_fusion`) and quack (`epilogues`) forms slot in beside them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model import Rope
from .qkv_epilogue import fp8_qkv_heads_into, generator_heads_into, repeat_heads


def post_split(layer, g: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Generator layer's half after attention, its last residual add left to the next layer (`generator_qkv`)."""
    return layer.generator_post_split(g, o)


def generator_qkv(layer, g: torch.Tensor, update: torch.Tensor | None, rope: Rope
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The previous layer's last residual add (`generator_post_split`), then `generator_pre` -> (q, k, v, g).
    Compiled, the add is part of the input norm's kernel: one pass over g fewer per layer (at Edge a 27 us add
    kernel per layer and step)."""
    if update is not None:
        g = g + update
    return (*layer.generator_pre(g, rope), g)


def generator_projections(layer, g: torch.Tensor, update: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`generator_qkv` up to the projections: (q [B, G, H*d], k, v [B, G, K*d], g), before the per-head norms and
    RoPE (which `qkv_epilogue.generator_heads_into` then applies in one kernel with the K/V buffer stores)."""
    if update is not None:
        g = g + update
    return (*layer.self_attn.generator_projections(layer.input_layernorm_moe_gen(g)), g)


def pre_into(qkv: Callable):
    """The Generator layer's half before attention: `qkv` (`generator_qkv` or its gen-fp8 form), writing K/V
    (heads repeated for GQA) into the step buffers from `start` on -> (q, g). Compiled by Inductor as a whole."""

    def run(layer, g: torch.Tensor, update: torch.Tensor | None, rope: Rope, kbuf: torch.Tensor,
            vbuf: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g = qkv(layer, g, update, rope)
        n = k.shape[2]
        kbuf[:, :, start : start + n] = repeat_heads(k, kbuf.shape[1])
        vbuf[:, :, start : start + n] = repeat_heads(v, vbuf.shape[1])
        return q, g

    return run


def pre_heads(projections: Callable):
    """`pre_into` with the part after the projections (`projections`: `generator_projections` or its gen-fp8
    form, compiled) in the Triton head epilogue (head_epilogue="triton")."""

    def run(layer, g: torch.Tensor, update: torch.Tensor | None, rope: Rope, kbuf: torch.Tensor,
            vbuf: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g = projections(layer, g, update)
        return generator_heads_into(layer.self_attn, q, k, v, rope, kbuf, vbuf, start), g

    return run


def pre_fp8_heads(norm_quant: Callable):
    """`pre_heads` for a gen-fp8 layer whose q/k/v GEMM carries the head epilogue (fp8_triton_gemms "qkv_heads"):
    `norm_quant` (`fp8_generator_norm_quant`) quantizes the normed rows, one kernel does the rest."""

    def run(layer, g: torch.Tensor, update: torch.Tensor | None, rope: Rope, kbuf: torch.Tensor,
            vbuf: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        xq, scale, g = norm_quant(layer, g, update)
        return fp8_qkv_heads_into(layer.self_attn, xq, scale, g.shape[:2], rope, kbuf, vbuf, start), g

    return run
