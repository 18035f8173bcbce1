"""The decode step's layers with their small kernels fused by Inductor, for the decode graphs to capture.

A CUDA graph of the eager step still replays ~45 kernels per Reasoner layer one by one (RMSNorms, q/k norms and
RoPE as separate elementwise ops, SiLU and the gate product). On the H200 at Nano a batch-1 step took 9.98 ms
against 3.15 ms of weight reads, and grew only 2.3 ms from batch 1 to 32: the time went to the number of kernels,
not to bytes (bench/results/decode/2026-12-05-602b653-nano/). Here the work before attention (input norm,
projections, q/k norms, RoPE) and after it (output projection, residuals, post-attention norm, MLP) are two
compiled regions, shared by every layer (parameters are graph inputs), compiled once per row count; attention
stays eager, since its key span changes from step to step.

`OneRowDecode` goes further at one row, where a step is GEMVs: each layer is four GEMV kernels (`ops/gemv_fused.py`:
RMSNorm inside the q/k/v and gate/up GEMVs, silu(gate) * up inside the down projection's, the residual adds in the
o and down projections' epilogues; seven where q/k/v and gate/up are separate matrices, as a served model shares
them with the policy: each then writes its slice of one [q | k | v] or [gate | up] buffer), and attention, whose
split-key kernel applies the q/k norms and RoPE as it loads the query and the new key (elsewhere they are compiled
between); then the final norm inside `lm_head`'s GEMV. With `pdl` (on by default where
`ops.triton_support.pdl_problem` is None) those kernels are launched with programmatic dependent launch: each may
start during the last wave of the one before it, reading its weights.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..model import Rope
from ..ops.gemv import GemvLinear
from ..ops.gemv_fused import gemv_add, norm_gemv, silu_gemv
from ..ops.triton_support import pdl_problem


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


def _heads(layer: Any, qkv: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    attn = layer.self_attn
    sizes = getattr(attn, "reasoner_qkv_sizes", None) or [p.weight.shape[0] for p in (attn.to_q, attn.to_k, attn.to_v)]
    q, k, _k_gen, v = attn.reasoner_heads(*qkv.split(sizes, dim=-1), rope)
    return q, k, v


def qkv_weights(attn: Any) -> list[torch.Tensor]:
    """The q/k/v matrices a step reads: one fused (`engine.fuse.fuse_reasoner`) or the model's three."""
    fused = getattr(attn, "qkv_proj", None)
    return [fused.weight] if fused is not None else [attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]


def gate_up_weights(mlp: Any) -> list[torch.Tensor]:
    """The gate/up matrices a step reads: one fused or the model's two."""
    fused = getattr(mlp, "gate_up_proj", None)
    return [fused.weight] if fused is not None else [mlp.gate_proj.weight, mlp.up_proj.weight]


def _norm_gemvs(u: torch.Tensor, norm: Any, weights: list[torch.Tensor], pdl: bool) -> torch.Tensor:
    """norm(u) @ [W_1 | W_2 | ...].T: one GEMV on a fused matrix, else one per matrix into its slice of one buffer."""
    if len(weights) == 1:
        return norm_gemv(u, norm, weights[0], pdl=pdl)
    out = u.new_empty(*u.shape[:-1], sum(w.shape[0] for w in weights))
    start = 0
    for w in weights:
        norm_gemv(u, norm, w, pdl=pdl, out=out[..., start:start + w.shape[0]])
        start += w.shape[0]
    return out


class OneRowDecode(FusedDecodeLayer):
    """`layer_fn` for `ReasonerLM.decode_step` that runs the whole stack (`run_stack`): at one row, GEMVs with the
    norms, SiLU * up and residual adds inside them (module docstring); at more rows, `FusedDecodeLayer` per layer
    (`compile_rows`; else the model's own layers, uncompiled: nothing compiles in a server). Takes the Reasoner's
    q/k/v and gate/up fused (`engine.fuse.fuse_reasoner`) or not; needs plain linear projections without biases and
    a gated MLP."""

    def __init__(self, mode: str | None = None, *, attention_prep: bool = True, pdl: bool = True,
                 compile_rows: bool = True) -> None:
        if compile_rows:
            super().__init__(mode)
        elif mode is not None:
            raise ValueError("a compile mode needs compile_rows=True")
        self.compile_rows = compile_rows
        self.heads = torch.compile(_heads, dynamic=False) if compile_rows else _heads
        # the q/k norms and RoPE inside the split-key attention kernel where it runs (`from_projections`), not in
        # the compiled `heads` region: two kernels a layer fewer
        self.attention_prep = attention_prep
        self.pdl = pdl  # where the device takes it (`run_stack`)

    @staticmethod
    def problem(lm: Any) -> str | None:
        """Why the one-row stack cannot run `lm`'s layers, or None."""
        for i, layer in enumerate(lm.transformer.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not getattr(mlp, "gated", True):
                return f"layer {i}: the one-row decode needs a gated (SiLU) MLP"
            qkv = [attn.qkv_proj] if getattr(attn, "qkv_proj", None) is not None else [attn.to_q, attn.to_k, attn.to_v]
            gate_up = ([mlp.gate_up_proj] if getattr(mlp, "gate_up_proj", None) is not None
                       else [mlp.gate_proj, mlp.up_proj])
            projections = [*qkv, attn.to_out, *gate_up, mlp.down_proj]
            # GemvLinear (`ops.gemv.use_gemv_kernel`) holds the same matrix; a quantized Reasoner (reasoner-w8) none
            if any(type(m) not in (torch.nn.Linear, GemvLinear) for m in projections):
                kind = next(type(m).__name__ for m in projections if type(m) not in (torch.nn.Linear, GemvLinear))
                return f"layer {i}: the one-row decode takes plain linear projections, not {kind}"
            if any(m.bias is not None for m in projections):
                return f"layer {i}: the one-row decode takes projections without biases"
        if lm.lm_head.bias is not None:
            return "lm_head has a bias: the one-row decode takes none"
        return None

    def run_stack(self, lm: Any, u: torch.Tensor, rope: Rope, attentions: list) -> torch.Tensor:
        """u [B, 1, h] embeddings -> logits [B, V], through every layer and the final norm."""
        if u.shape[0] != 1:
            for layer, attn in zip(lm.transformer.layers, attentions, strict=True):
                u = self(layer, u, rope, attn) if self.compile_rows else layer.reasoner(u, rope, attn)[0]
            return lm._logits(u)[:, 0]
        pdl = self.pdl and pdl_problem(u.device) is None
        for layer, attn in zip(lm.transformer.layers, attentions, strict=True):
            qkv = _norm_gemvs(u, layer.input_layernorm, qkv_weights(layer.self_attn), pdl)
            o = attn.from_projections(qkv, layer.self_attn, rope, pdl=pdl) if self.attention_prep else None
            if o is None:
                o = attn(*self.heads(layer, qkv, rope), causal=True, key_mask=None)
            # after an attention of torch's kernels (SDPA, or the compiled heads) PDL is harmless: without the
            # kernel's trigger the next launch waits for it to finish
            u = gemv_add(o.transpose(1, 2).flatten(2), layer.self_attn.to_out.weight, u, pdl=pdl)
            gate_up = _norm_gemvs(u, layer.post_attention_layernorm, gate_up_weights(layer.mlp), pdl)
            u = silu_gemv(gate_up, layer.mlp.down_proj.weight, residual=u, pdl=pdl)
        logits = norm_gemv(u, lm.transformer.norm, lm.lm_head.weight, pdl=pdl)
        return logits.float()[:, 0]
