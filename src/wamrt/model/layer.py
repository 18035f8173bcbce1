"""One Mixture-of-Transformers layer: a Reasoner weight set and a Generator weight set.

Parameter names mirror the diffusers checkpoint layout (`self_attn.to_q`, `mlp_moe_gen.up_proj`, ...).
The Reasoner half and the Generator half are separate methods so an engine can run the Reasoner once
per prompt and the Generator at every denoising step against the cached Reasoner K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionFn, ControlSegments, control_attention
from .config import Cosmos3Config
from .norms import RMSNorm
from .rope import Rope, apply_rope


class MLP(nn.Module):
    """SiLU-gated (gate/up/down) or ReLU^2 (up/down) feed-forward block."""

    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        self.gated = cfg.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The input projections (an engine may serve both from one fused matrix)."""
        return (self.gate_proj(x) if self.gated else None), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        if gate is not None:
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(torch.relu(up).square())


class MoTAttention(nn.Module):
    """Projections and per-head norms of both streams. The attention op itself is passed in."""

    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        bias, eps, nem = cfg.attention_bias, cfg.rms_norm_eps, cfg.nemotron_norm
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        # Reasoner (text) stream.
        self.to_q = nn.Linear(h, nq, bias=bias)
        self.to_k = nn.Linear(h, nkv, bias=bias)
        self.to_v = nn.Linear(h, nkv, bias=bias)
        self.to_out = nn.Linear(nq, h, bias=bias)
        self.norm_q: nn.Module = RMSNorm(d, eps, nemotron=nem) if cfg.qk_norm_for_text else nn.Identity()
        self.norm_k: nn.Module = RMSNorm(d, eps, nemotron=nem) if cfg.qk_norm_for_text else nn.Identity()
        # Edge: Generator queries see the Reasoner keys through one more per-head norm.
        self.k_norm_und_for_gen = RMSNorm(d, eps, nemotron=nem) if cfg.has_und_k_norm_for_gen else None
        # Generator (vision / sound / action) stream.
        self.add_q_proj = nn.Linear(h, nq, bias=bias)
        self.add_k_proj = nn.Linear(h, nkv, bias=bias)
        self.add_v_proj = nn.Linear(h, nkv, bias=bias)
        self.to_add_out = nn.Linear(nq, h, bias=bias)
        self.norm_added_q = RMSNorm(d, eps, nemotron=nem)
        self.norm_added_k = RMSNorm(d, eps, nemotron=nem)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.head_dim))  # [B, S, n, d]

    def reasoner_qkv(
        self, x: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, U, h] (normed) -> q [B, H, U, d], k, k_for_gen, v [B, K, U, d] (after norm + RoPE)."""
        return self.reasoner_heads(*self.reasoner_projections(x), rope)

    def reasoner_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' outputs [B, U, H*d] / [B, U, K*d] -> per-head norms and RoPE: q [B, H, U, d], k,
        k_for_gen, v [B, K, U, d]."""
        q = self.norm_q(self._heads(q, self.num_heads))
        k = self.norm_k(self._heads(k, self.num_kv_heads))
        v = self._heads(v, self.num_kv_heads)
        k_gen = self.k_norm_und_for_gen(k) if self.k_norm_und_for_gen is not None else k
        q, k_rot = apply_rope(q, rope), apply_rope(k, rope)
        k_gen = apply_rope(k_gen, rope) if self.k_norm_und_for_gen is not None else k_rot
        return q.transpose(1, 2), k_rot.transpose(1, 2), k_gen.transpose(1, 2), v.transpose(1, 2)

    def reasoner_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Reasoner's three input projections (an engine may serve them from one fused matrix)."""
        return self.to_q(x), self.to_k(x), self.to_v(x)

    def generator_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three input projections (an engine may serve them from one fused matrix)."""
        return self.add_q_proj(x), self.add_k_proj(x), self.add_v_proj(x)

    def generator_qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, G, h] (normed) -> q [B, H, G, d], k, v [B, K, G, d]."""
        return self.generator_heads(*self.generator_projections(x), rope)

    def generator_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' outputs [B, G, H*d] / [B, G, K*d] -> per-head norms and RoPE, [B, heads, G, d]."""
        q = apply_rope(self.norm_added_q(self._heads(q, self.num_heads)), rope)
        k = apply_rope(self.norm_added_k(self._heads(k, self.num_kv_heads)), rope)
        v = self._heads(v, self.num_kv_heads)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class MoTLayer(nn.Module):
    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        h, eps, nem = cfg.hidden_size, cfg.rms_norm_eps, cfg.nemotron_norm
        self.self_attn = MoTAttention(cfg)
        self.mlp = MLP(cfg)
        self.mlp_moe_gen = MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps, nemotron=nem)
        self.post_attention_layernorm = RMSNorm(h, eps, nemotron=nem)
        self.input_layernorm_moe_gen = RMSNorm(h, eps, nemotron=nem)
        self.post_attention_layernorm_moe_gen = RMSNorm(h, eps, nemotron=nem)

    def reasoner(
        self, u: torch.Tensor, rope: Rope, attn: AttentionFn, *, need_output: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Reasoner half: u [B, U, h] -> (next u or None, k_for_gen [B, K, U, d], v [B, K, U, d]).

        With need_output=False (the last layer) only the K/V the Generator reads are computed.
        """
        q, k, k_gen, v = self.reasoner_pre(u, rope)
        if not need_output:
            return None, k_gen, v
        return self.reasoner_post(u, attn(q, k, v, causal=True, key_mask=None)), k_gen, v

    def reasoner_pre(self, u: torch.Tensor, rope: Rope
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u [B, U, h] -> q [B, H, U, d], k, k_for_gen, v [B, K, U, d]: the Reasoner half up to its attention."""
        return self.self_attn.reasoner_qkv(self.input_layernorm(u), rope)

    def reasoner_post(self, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, H, U, d] attention output -> next u [B, U, h]."""
        u = u + self.self_attn.to_out(o.transpose(1, 2).flatten(2))
        return u + self.mlp(self.post_attention_layernorm(u))

    def generator(
        self,
        g: torch.Tensor,
        rope: Rope,
        und_k: torch.Tensor,
        und_v: torch.Tensor,
        attn: AttentionFn,
        und_key_mask: torch.Tensor | None = None,
        controls: ControlSegments | None = None,
    ) -> torch.Tensor:
        """Generator half: g [B, G, h] attends to [Reasoner K/V ; own K/V] with no mask (bar padding); a transfer
        sequence with several controls (`controls`) attends in one pass per control (`control_attention`)."""
        q, k, v = self.generator_pre(g, rope)
        keys = torch.cat((und_k, k), dim=2)  # [B, K, U+G, d]
        values = torch.cat((und_v, v), dim=2)
        key_mask = None
        if und_key_mask is not None:
            gen_ones = und_key_mask.new_ones(und_key_mask.shape[0], k.shape[2])
            key_mask = torch.cat((und_key_mask, gen_ones), dim=1)
        if controls is not None and controls.count > 1:
            o = control_attention(attn, q, keys, values, gen_at=und_k.shape[2], seg=controls, key_mask=key_mask)
        else:
            o = attn(q, keys, values, causal=False, key_mask=key_mask)
        return self.generator_post(g, o)

    # The Generator half around its attention op, as two pieces an engine can compile on their own.
    def generator_pre(self, g: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.generator_qkv(self.input_layernorm_moe_gen(g), rope)

    def generator_post(self, g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, H, G, d] attention output -> next g [B, G, h]."""
        g, update = self.generator_post_split(g, o)
        return g + update

    def generator_post_split(self, g: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`generator_post` before its last residual add: (g after the attention's residual, the MLP's update).
        An engine can make that add part of the next layer's input norm, which reads g anyway."""
        g = g + self.self_attn.to_add_out(o.transpose(1, 2).flatten(2))
        return g, self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(g))
