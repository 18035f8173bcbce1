"""Weight fusion applied to a loaded model from outside: one GEMM for the Generator's q/k/v and one
for gate/up, instead of three and two. The model's modules keep their math; only the projection
methods are served from the fused matrix (by swapping the module's class to a subclass).

`fuse_reasoner` does the same for the Reasoner stream, for its text decode: at batch 1 a decode step is GEMVs, and
five launches a layer where two do the same reads are part of its fixed cost (bench/results/decode/). The policy
engine does not apply it: the Reasoner's K/V of a policy request is computed once per prompt and cached."""

from __future__ import annotations

import torch
from torch import nn

from ..model import Cosmos3Transformer
from ..model.layer import MLP, MoTAttention


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight for p in parts], dim=0)
    has_bias = parts[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class FusedGeneratorQKV(MoTAttention):
    def generator_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.add_qkv_proj(x).split(self.qkv_sizes, dim=-1)


class FusedGateUp(MLP):
    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up


class FusedReasonerQKV(MoTAttention):
    def reasoner_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(x).split(self.reasoner_qkv_sizes, dim=-1)


class FusedQKV(FusedGeneratorQKV, FusedReasonerQKV):
    """Both streams' q/k/v from their fused matrices (the two fusions in either order)."""


def fuse_reasoner(model: Cosmos3Transformer, *, drop_originals: bool = True) -> Cosmos3Transformer:
    """Fuse the Reasoner stream's q/k/v and gate/up projections of every layer (idempotent). With drop_originals the
    separate matrices go (one copy in memory); `to_q` / `to_k` / `to_v` then exist only inside `qkv_proj`."""
    for layer in model.layers:
        attn = layer.self_attn
        if not isinstance(attn, FusedReasonerQKV):
            parts = [attn.to_q, attn.to_k, attn.to_v]
            if any(type(p) is not nn.Linear for p in parts):  # a quantized Reasoner (reasoner-w8) keeps its layers
                raise TypeError(f"fuse_reasoner needs plain nn.Linear projections, not {type(parts[0]).__name__}")
            attn.qkv_proj = _fused_linear(parts)
            attn.reasoner_qkv_sizes = [p.weight.shape[0] for p in parts]
            attn.__class__ = FusedQKV if isinstance(attn, FusedGeneratorQKV) else FusedReasonerQKV
            if drop_originals:
                attn.to_q = attn.to_k = attn.to_v = None
        _fuse_gate_up(layer.mlp, drop_originals)
    return model


def fold_reasoner_norms(model: Cosmos3Transformer, lm_head: nn.Linear | None = None) -> int:
    """Fold each Reasoner RMSNorm's weight into the one matrix that reads its output (input_layernorm into q/k/v,
    post_attention_layernorm into gate/up, the final norm into `lm_head` unless it shares the embedding's storage),
    leaving the norm's weight at ones and marked `folded`: `ops.gemv_fused.norm_gemv` then reads no norm weight.
    The same function up to one bf16 rounding of the matrix (W * w rounded once, where the eager norm rounds its
    product with w). Needs `fuse_reasoner`'s matrices (the norms feed nothing else); idempotent. Returns how many
    norms it folded."""
    pairs = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, FusedReasonerQKV) or not isinstance(mlp, FusedGateUp):
            raise TypeError(f"layer {i}: fold_reasoner_norms needs fuse_reasoner's q/k/v and gate/up matrices")
        pairs += [(layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj)]
    if lm_head is not None and lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr():
        pairs.append((model.norm, lm_head))
    folded = 0
    with torch.no_grad():
        for norm, linear in pairs:
            if getattr(norm, "folded", False):
                continue
            w = linear.weight
            w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
            norm.weight.fill_(1)
            norm.folded = True
            folded += 1
    return folded


def _fuse_gate_up(mlp: MLP, drop_originals: bool) -> None:
    if mlp.gated and not isinstance(mlp, FusedGateUp):
        mlp.gate_up_proj = _fused_linear([mlp.gate_proj, mlp.up_proj])
        mlp.__class__ = FusedGateUp
        if drop_originals:
            mlp.gate_proj = mlp.up_proj = None


def fuse_generator(model: Cosmos3Transformer, *, drop_originals: bool = True) -> Cosmos3Transformer:
    """Fuse the Generator stream's q/k/v and gate/up projections of every layer (idempotent)."""
    for layer in model.layers:
        attn = layer.self_attn
        if not isinstance(attn, FusedGeneratorQKV):
            parts = [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]
            attn.add_qkv_proj = _fused_linear(parts)
            attn.qkv_sizes = [p.weight.shape[0] for p in parts]
            attn.__class__ = FusedQKV if isinstance(attn, FusedReasonerQKV) else FusedGeneratorQKV
            if drop_originals:  # the fused copy replaces them; keeps memory at one copy
                for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
                    setattr(attn, name, None)
        _fuse_gate_up(layer.mlp_moe_gen, drop_originals)
    return model
