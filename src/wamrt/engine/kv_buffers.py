"""The K/V buffers a batch's Generator passes attend over, and the arena captured graphs take them from.

Per layer one [S, H, Umax + G, d] key and one value buffer per batch of CFG branches: the Reasoner prefixes (padded,
heads repeated for GQA where the attention needs them) are written once per request batch; each step writes the
Generator K/V beside them from inside the compiled projection, so no per-step cat or expand. Two layouts:
[prefix left-padded | Generator] (per-sequence calls on a suffix, masks, prompt buckets), or generator-first
[Generator | prefix | zeros], each sequence's keys a prefix of its row (one call on fa4: `KeyLengthAttention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..model import Cosmos3Config, ReasonerKV, Rope
from ..ops.attention import (
    KeyLengthAttention,
    KeyMaskAttention,
    MaskedBatchAttention,
    PrefixOffsetAttention,
    ZeroKeyAttention,
)
from .prefix_cache import kv_storage


@dataclass
class BatchBranch:
    """One CFG branch of one request inside a batch."""

    request: int
    kv: ReasonerKV  # [1, K, U, d] per layer
    rope: Rope  # Generator part, [1, G, d]


@dataclass
class ControlPassAttention:
    """The attention op of a transfer batch with several controls: `whole` over every key (the op's usual contract),
    `per_pass` over the keys of one control pass (`model.attention.control_attention`), (N - 1) controls fewer."""

    whole: Any
    per_pass: Any

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.whole(q, k, v, causal=causal, key_mask=key_mask)


@dataclass
class KVBuffers:
    keys: list[torch.Tensor]  # per layer [S, H, start + G, d]
    values: list[torch.Tensor]
    start: int  # where the Generator part begins


class KVBufferArena:
    """Builds a batch's K/V buffers and the attention op that reads them (`buffers`). While a graph is warmed up or
    captured (`allocating`) the buffers are regions of one arena [layers, 2 (k, v), elements] allocated outside the
    capture, which every captured graph shares; otherwise fresh tensors.

    `layout`: the engine's resolved cfg_attention ("lengths": generator-first; "mask": one masked call over the
    left-padded layout; otherwise per-sequence suffix calls). `grouped`: buffers at the model's K/V heads in the
    generator-first layout (the kernel shares them across query heads). `bucket_attention` ("lse" or "mask") and
    `rescale`: how prompt-bucket padding is kept out of the softmax."""

    def __init__(self, config: Cosmos3Config, device: torch.device, *, layout: str, grouped: bool, backend: str,
                 bucket_attention: str, rescale: Callable[..., torch.Tensor]) -> None:
        self.config, self.device = config, device
        self.layout, self.grouped, self.backend = layout, grouped, backend
        self.bucket_attention, self.rescale = bucket_attention, rescale
        self.arena: torch.Tensor | None = None  # [layers, 2 (k, v), elements]
        self._cursor: int | None = None  # set while a graph is being warmed up / captured

    def heads(self, seqs: list[BatchBranch]) -> int:
        """Heads of a batch's buffers: the model's K/V heads when grouped in the generator-first layout, else the
        query heads."""
        grouped = self.grouped and self.layout == "lengths" and all(s.kv.key_mask is None for s in seqs)
        return self.config.num_key_value_heads if grouped else self.config.num_attention_heads

    def elements(self, kinds: list[list[BatchBranch]]) -> int:
        """The arena elements (per layer and per k or v) of one loop's batches `kinds`."""
        return sum(len(seqs) * self.heads(seqs) * (max(s.kv.length for s in seqs) + seqs[0].rope.cos.shape[1])
                   * self.config.head_dim for seqs in kinds)

    def reserve(self, kinds: list[list[BatchBranch]]) -> torch.Tensor:
        """The arena, grown (replaced) when `kinds` need more than it holds. Graphs captured on the old one keep it
        alive through their own reference: warm the largest batch first."""
        need = self.elements(kinds)
        if self.arena is None or self.arena.shape[-1] < need:
            self.arena = None
            self.arena = torch.empty(self.config.num_hidden_layers, 2, need, device=self.device,
                                     dtype=kinds[0][0].kv.keys[0].dtype)
        return self.arena

    @contextmanager
    def allocating(self) -> Iterator[None]:
        """Buffers from the arena (from its start) until the block ends."""
        self._cursor = 0
        try:
            yield
        finally:
            self._cursor = None

    def rewind(self) -> None:
        """Back to the arena's start: each warm-up run and the capture of one loop take the same regions."""
        if self._cursor is not None:
            self._cursor = 0

    def buffers(self, seqs: list[BatchBranch], control_pass_drop: int = 0) -> tuple[KVBuffers, Rope, Any]:
        """The batch's K/V buffers with its Reasoner prefixes written, its Generator RoPE, its attention op (a
        `ControlPassAttention` when `control_pass_drop` > 0: a transfer batch whose control passes attend over that
        many keys fewer)."""
        g_len = seqs[0].rope.cos.shape[1]
        masks = [s.kv.key_mask for s in seqs]
        bucketed = any(m is not None for m in masks)
        generator_first = self.layout == "lengths" and not bucketed
        lengths = [s.kv.length for s in seqs]
        umax = max(lengths)
        pads = [umax - n for n in lengths]
        shape = (len(seqs), self.heads(seqs), umax + g_len, self.config.head_dim)
        layers = len(seqs[0].kv.keys)
        region = self._region(math.prod(shape))
        both = (seqs[0].kv.keys[0].new_empty(layers, 2, *shape) if region is None  # [L, 2 (k, v), S, H, T, d]
                else self.arena[:, :, region].view(layers, 2, *shape))  # type: ignore[index]
        # Every layer's prefix in one copy per sequence (its heads repeated for GQA by broadcasting) and the padding
        # in one fill: per-layer pads, cats and copies were ~330 kernels and ~1 ms of an Edge E7 replay
        # (bench/results/latency/2026-12-03-1bdd8a5-edges/).
        for row, (seq, pad) in enumerate(zip(seqs, pads, strict=True)):
            src = kv_storage(seq.kv)[:, :, 0]  # [L, 2, K, U, d]
            at = g_len if generator_first else pad
            dst = both[:, :, row, :, at : at + seq.kv.length]
            dst.unflatten(2, (src.shape[2], shape[1] // src.shape[2])).copy_(src.unsqueeze(3))
            if pad:
                zeros = slice(g_len + seq.kv.length, g_len + umax) if generator_first else slice(0, pad)
                both[:, :, row, :, zeros].zero_()
        bufs = KVBuffers(list(both[:, 0].unbind(0)), list(both[:, 1].unbind(0)), 0 if generator_first else umax)
        rope = Rope(torch.cat([s.rope.cos for s in seqs]), torch.cat([s.rope.sin for s in seqs]))
        attn = self._attention(masks, pads, umax, g_len, generator_first)
        if control_pass_drop:
            attn = ControlPassAttention(attn, self._attention(masks, pads, umax, g_len - control_pass_drop,
                                                              generator_first))
        return bufs, rope, attn

    def _attention(self, masks: list, pads: list[int], umax: int, g_len: int, generator_first: bool) -> Any:
        """The attention op over [prefixes (padded to umax: `masks` or `pads`) ; g_len Generator keys] in this
        layout."""
        if any(m is not None for m in masks):  # prompt buckets: equal padded widths, validity as data
            assert all(m is not None for m in masks) and not any(pads)
            valid = torch.cat(masks)  # type: ignore[arg-type]
            valid = torch.cat([valid, valid.new_ones(len(masks), g_len)], dim=1)
            if self.bucket_attention == "lse":
                return ZeroKeyAttention(valid, backend=self.backend, rescale=self.rescale)
            return KeyMaskAttention(valid, backend=self.backend)
        if generator_first:
            return KeyLengthAttention([g_len + umax - p for p in pads], self.device, backend=self.backend)
        if self.layout == "mask" and any(pads):
            return MaskedBatchAttention(pads, umax + g_len, self.device, backend=self.backend)
        return PrefixOffsetAttention(pads, backend=self.backend)

    def _region(self, n: int) -> slice | None:
        """The next n elements of the arena while allocating, else None."""
        if self._cursor is None:
            return None
        start, self._cursor = self._cursor, self._cursor + n
        assert self.arena is not None and self._cursor <= self.arena.shape[-1], "arena too small"
        return slice(start, self._cursor)
