"""The Reasoner as a causal language model over a static K/V cache.

It is the served transformer's own Reasoner half (`MoTLayer.reasoner`, the Reasoner final `norm`) plus the
checkpoint's `lm_head`, which the transformer never reads. Nothing of the model is copied or rewritten: the cache
comes in through the attention function `MoTLayer.reasoner` takes, so the layer math is the model's.

Positions are Qwen3-VL's 3-D MRoPE ids: text token i sits at (i, i, i) and a generated token continues after the
largest position of its prompt, so text-only prompts run ordinary 1-D RoPE. DeepStack features (vision) are added
to the hidden states of the media tokens after the first layers, one feature map per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..model import Cosmos3Transformer, Rope, sdpa_attention
from ..ops.decode_attention import (
    additive_mask,
    decode_attention,
    decode_attention_from_projections,
    decode_attention_from_projections_problem,
    sdpa_over_cache,
)

LayerFn = Callable[..., torch.Tensor]  # (layer, u [B, 1, h], rope, attention) -> the next u


@dataclass
class KVCache:
    """Per-layer Reasoner keys (after norm and RoPE) and values of up to `batch` sequences: [L, B, K, S, d].
    `arrivals` [L, B, K] int32: the split-key attention kernel's counters, zero between steps, with which the last
    split program of each K/V head merges the splits itself (`ops.decode_attention`); None: a merge kernel does."""

    keys: torch.Tensor
    values: torch.Tensor
    arrivals: torch.Tensor | None = None

    @classmethod
    def empty(cls, model: Cosmos3Transformer, batch: int, length: int, *, merge_in_split: bool = False) -> KVCache:
        c = model.config
        p = model.embed_tokens.weight
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, length, c.head_dim)
        arrivals = (torch.zeros(shape[:3], dtype=torch.int32, device=p.device)
                    if merge_in_split and p.device.type == "cuda" else None)
        return cls(*(torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(2)), arrivals)

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class DeepStack:
    """Vision features added after the first `len(features)` layers at the media tokens (`mask` [U] bool)."""

    mask: torch.Tensor
    features: list[torch.Tensor]  # each [n_media_tokens, hidden]


class _PrefillAttention:
    """A fresh prompt in cache row `row`: causal self-attention over its own K/V, which it writes to the cache."""

    def __init__(self, cache: KVCache | None, layer: int, row: int) -> None:
        self.cache, self.layer, self.row = cache, layer, row

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 key_mask: torch.Tensor | None) -> torch.Tensor:
        if self.cache is not None:
            n = k.shape[2]
            self.cache.keys[self.layer, self.row, :, :n] = k[0]
            self.cache.values[self.layer, self.row, :, :n] = v[0]
        return sdpa_attention(q, k, v, causal=True)


DECODE_ATTENTION = ("sdpa", "split")  # `decode_step(attention=)`: SDPA, or the split-key kernel (ops.decode_attention)


class _DecodeAttention:
    """One new token in each of the first B cache rows: its K/V goes to position `index[b]` of its row, its query
    attends to the row's first `span` positions up to its own: with "sdpa", SDPA under `mask` ([B, 1, 1, span],
    additive); with "split", `ops.decode_attention`'s kernel, which also writes the cache."""

    def __init__(self, cache: KVCache, layer: int, index: torch.Tensor, mask: torch.Tensor | None,
                 rows: torch.Tensor, span: int, kind: str = "sdpa") -> None:
        # rows: arange(B), made once per step for every layer (a kernel launch a layer otherwise)
        self.cache, self.layer, self.index, self.mask, self.rows = cache, layer, index, mask, rows
        self.span, self.kind = span, kind

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 key_mask: torch.Tensor | None) -> torch.Tensor:
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]  # [B_max, K, S, d]
        if self.kind == "split":
            return decode_attention(q, k, v, keys, values, self.index, self.span, arrivals=self._arrivals())
        assert self.mask is not None
        keys[self.rows, :, self.index] = k[:, :, 0]
        values[self.rows, :, self.index] = v[:, :, 0]
        return sdpa_over_cache(q, keys, values, self.mask, k.shape[1])

    def _arrivals(self) -> torch.Tensor | None:
        return None if self.cache.arrivals is None else self.cache.arrivals[self.layer]

    def from_projections(self, qkv: torch.Tensor, attn: nn.Module, rope: Rope, *, pdl: bool = False
                         ) -> torch.Tensor | None:
        """The same attention from the step's raw q/k/v projections qkv [B, 1, (H + 2K) d], with `attn`'s per-head
        norms and RoPE applied inside the split kernel (launched with PDL if `pdl`); None where that kernel cannot
        take them (then run `MoTAttention.reasoner_heads` and call this object)."""
        if self.kind != "split":
            return None
        norm_q, norm_k = (n if getattr(n, "weight", None) is not None else None for n in (attn.norm_q, attn.norm_k))
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        if decode_attention_from_projections_problem(qkv, keys, values, norm_q, norm_k, rope.cos):
            return None
        return decode_attention_from_projections(qkv, attn.num_heads, attn.num_kv_heads, norm_q, norm_k, rope.cos,
                                                 rope.sin, keys, values, self.index, self.span,
                                                 arrivals=self._arrivals(), pdl=pdl)


class ReasonerLM(nn.Module):
    """The served transformer's Reasoner stream + `lm_head`: prefill a prompt into a cache row, decode one token per
    row per step. `transformer` is shared, not copied (the Generator reads the same weights)."""

    def __init__(self, transformer: Cosmos3Transformer, lm_head: nn.Linear) -> None:
        super().__init__()
        vocab, hidden = lm_head.weight.shape
        if hidden != transformer.config.hidden_size:
            raise ValueError(f"lm_head is [{vocab}, {hidden}], the transformer's hidden size is "
                             f"{transformer.config.hidden_size}")
        self.transformer, self.lm_head = transformer, lm_head
        self._text_rope: dict[tuple[int, torch.device, torch.dtype], Rope] = {}

    @property
    def config(self):  # noqa: ANN201 - Cosmos3Config
        return self.transformer.config

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> Rope:
        return self.transformer.rope(positions)

    def text_rope(self, rope_pos: torch.Tensor, length: int) -> Rope:
        """The cos/sin rows [B, 1, d] of one text token per row at MRoPE position rope_pos [B] (equal on the three
        axes; long or integral float), gathered from tables of the positions 0..length-1 made once per length: the
        values `rope` gives at those positions. At one row of a Nano step that is two gathers where `rope` runs ~12
        small kernels (arange, power, products, strided copies, concatenation, cos, sin, casts), each with its gap in
        the graph. A text position never passes its cache position (`prompt.mrope_positions`: a medium advances the
        positions by at most its token count), so `length` = the cache's; a larger position is an indexing error."""
        key = (length, self.device, self.dtype)
        table = self._text_rope.get(key)
        if table is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a graph would rebuild the table at every replay (DecodeGraphs builds it in the warm-up before)
                return self.rope(rope_pos.float()[:, None, None].expand(rope_pos.shape[0], 3, 1))
            positions = torch.arange(length, dtype=torch.float32, device=self.device)
            full = self.rope(positions[None, None].expand(1, 3, length))
            table = self._text_rope[key] = Rope(full.cos[0], full.sin[0])
        rows = rope_pos if rope_pos.dtype == torch.long else rope_pos.long()
        return Rope(table.cos[rows][:, None], table.sin[rows][:, None])

    def _logits(self, u: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.norm(u)).float()

    def run_prompt(self, embeds: torch.Tensor, positions: torch.Tensor, *, cache: KVCache | None = None, row: int = 0,
                   deepstack: DeepStack | None = None, all_logits: bool = False) -> torch.Tensor:
        """embeds [1, U, h], positions [1, 3, U] -> logits [1, V] of the last token ([1, U, V] with `all_logits`),
        writing the prompt's K/V to `cache` row `row` when a cache is given."""
        u = embeds
        rope = self.rope(positions)
        for i, layer in enumerate(self.transformer.layers):
            u, _, _ = layer.reasoner(u, rope, _PrefillAttention(cache, i, row))
            if deepstack is not None and i < len(deepstack.features):
                u = u.clone()
                u[:, deepstack.mask] = u[:, deepstack.mask] + deepstack.features[i].to(u.dtype)
        return self._logits(u) if all_logits else self._logits(u[:, -1:])[:, 0]

    def decode_step(self, cache: KVCache, tokens: torch.Tensor, index: torch.Tensor, rope_pos: torch.Tensor,
                    span: int, layer_fn: LayerFn | None = None, attention: str = "sdpa") -> torch.Tensor:
        """One token for each of the first B cache rows: tokens [B] long, index [B] long (its cache position),
        rope_pos [B] (its MRoPE position, equal on the three axes; `text_rope`) -> logits [B, V]. Keys beyond `span` are
        not read: pass the smallest span that covers every row's index. `layer_fn(layer, u, rope, attention)`
        runs one layer's Reasoner half (default: `MoTLayer.reasoner`; `fused.FusedDecodeLayer` compiles it); one
        with a `run_stack(lm, u, rope, attentions)` method runs all of them and the logits (`fused.OneRowDecode`).
        `attention`: one of `DECODE_ATTENTION` (see `_DecodeAttention`)."""
        b = tokens.shape[0]
        u = self.embed(tokens)[:, None]  # [B, 1, h]
        rope = self.text_rope(rope_pos, cache.length)
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"decode attention {attention!r}: one of {', '.join(DECODE_ATTENTION)}")
        # Additive, in the model's dtype, made once a step: SDPA turns a boolean mask into this in every layer
        # (bench/results/decode/2026-12-06-0230412-nano-h100: a bf16 fill twice a layer and an elementwise kernel
        # once, 0.17 ms of a batch-1 Nano step on the H100, which this is meant to remove; not measured yet).
        mask = additive_mask(index, span, u.dtype) if attention == "sdpa" else None
        rows = torch.arange(b, device=tokens.device)
        attentions = [_DecodeAttention(cache, i, index, mask, rows, span, attention)
                      for i in range(len(self.transformer.layers))]
        if hasattr(layer_fn, "run_stack"):  # a whole-stack runner (`fused.OneRowDecode`)
            return layer_fn.run_stack(self, u, rope, attentions)
        for layer, attn in zip(self.transformer.layers, attentions, strict=True):
            u = layer.reasoner(u, rope, attn)[0] if layer_fn is None else layer_fn(layer, u, rope, attn)
        return self._logits(u)[:, 0]
