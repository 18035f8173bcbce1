"""Weight fusion applied to a loaded model from outside: one GEMM for the Generator's q/k/v and one
for gate/up, instead of three and two. The model's modules keep their math; only the projection
methods are served from the fused matrix (by swapping the module's class to a subclass)."""

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


def fuse_generator(model: Cosmos3Transformer, *, drop_originals: bool = True) -> Cosmos3Transformer:
    """Fuse the Generator stream's q/k/v and gate/up projections of every layer (idempotent)."""
    for layer in model.layers:
        attn = layer.self_attn
        if not isinstance(attn, FusedGeneratorQKV):
            parts = [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]
            attn.add_qkv_proj = _fused_linear(parts)
            attn.qkv_sizes = [p.weight.shape[0] for p in parts]
            attn.__class__ = FusedGeneratorQKV
            if drop_originals:  # the fused copy replaces them; keeps memory at one copy
                for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
                    setattr(attn, name, None)
        mlp = layer.mlp_moe_gen
        if mlp.gated and not isinstance(mlp, FusedGateUp):
            mlp.gate_up_proj = _fused_linear([mlp.gate_proj, mlp.up_proj])
            mlp.__class__ = FusedGateUp
            if drop_originals:
                mlp.gate_proj = mlp.up_proj = None
    return model
