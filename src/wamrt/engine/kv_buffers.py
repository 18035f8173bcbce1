"""The K/V buffers a batch's Generator passes attend over, and the arena captured graphs take them from.

A [S, H, Umax + G, d] key and value buffer per batch of CFG branches: the Reasoner prefixes (padded, heads repeated
for GQA where the attention needs them) beside the Generator K/V, which each step writes from inside the compiled
projection, so no per-step cat or expand. Two layouts: [prefix left-padded | Generator] (per-sequence calls on a
suffix, masks, prompt buckets), or generator-first [Generator | prefix | zeros], each sequence's keys a prefix of its
row (one call on fa4: `KeyLengthAttention`).

Shared (the default, `EngineConfig.shared_kv_buffer`): one buffer serves every layer. A layer's Generator K/V is read
by that layer's attention only, within the step that wrote it, so only the prefixes differ between layers: they are
kept once per batch at the model's K/V heads ([L, 2, S, K, Umax, d]) and each layer copies its own into the buffer
before its pass (`KVBuffers.layer`: one copy kernel, ~0.1 % of a Nano request). Per layer instead, the buffers were
L times the Generator's K/V: 31 GiB at Nano batch 8, width 512, against 2 GiB shared.
"""

from __future__ import annotations

import math
import threading
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
    keys: list[torch.Tensor]  # per layer [S, H, start + G, d] (shared: one tensor for every layer)
    values: list[torch.Tensor]
    start: int  # where the Generator part begins
    # Shared: the buffer pair [2, S, H, T, d], every layer's prefixes [L, 2, S, K, Umax, d] and where they go in it
    work: torch.Tensor | None = None
    prefixes: torch.Tensor | None = None
    prefix_at: int = 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value buffers, its own Reasoner prefixes written into them first when every layer
        shares one pair (one copy for keys and values, the K/V heads repeated for GQA by broadcasting)."""
        if self.prefixes is not None:
            assert self.work is not None
            src = self.prefixes[index]  # [2, S, K, Umax, d]
            dst = self.work[:, :, :, self.prefix_at : self.prefix_at + src.shape[3]]
            dst.unflatten(2, (src.shape[2], -1)).copy_(src.unsqueeze(3))
        return self.keys[index], self.values[index]


def step_buffer_elements(*, sequences: int, heads: int, kv_heads: int, prefix: int, generator: int, head_dim: int,
                         layers: int, shared: bool) -> int:
    """Elements of one batch's K/V step buffers (`KVBufferArena.buffers`): per layer, or one shared pair plus every
    layer's prefixes at the K/V heads. What the arena holds and the memory plan counts."""
    pair = 2 * sequences * heads * (prefix + generator) * head_dim
    if not shared:
        return layers * pair
    return pair + layers * 2 * sequences * kv_heads * prefix * head_dim


class KVBufferArena:
    """Builds a batch's K/V buffers and the attention op that reads them (`buffers`). While a graph is captured
    (`allocating`, per thread: a background capture and the request path never share a cursor) the buffers are regions
    of one flat arena allocated outside the capture, which every captured graph shares; otherwise fresh tensors.

    `layout`: the engine's resolved cfg_attention ("lengths": generator-first; "mask": one masked call over the
    left-padded layout; otherwise per-sequence suffix calls). `grouped`: buffers at the model's K/V heads in the
    generator-first layout (the kernel shares them across query heads). `bucket_attention` ("lse" or "mask") and
    `rescale`: how prompt-bucket padding is kept out of the softmax."""

    def __init__(self, config: Cosmos3Config, device: torch.device, *, layout: str, grouped: bool, backend: str,
                 bucket_attention: str, rescale: Callable[..., torch.Tensor], shared: bool = True) -> None:
        self.config, self.device = config, device
        self.layout, self.grouped, self.backend = layout, grouped, backend
        self.bucket_attention, self.rescale, self.shared = bucket_attention, rescale, shared
        self.arena: torch.Tensor | None = None  # flat: every buffer of one loop, one region after the other
        self._local = threading.local()  # .cursor: set while this thread captures a graph

    @property
    def _cursor(self) -> int | None:
        return getattr(self._local, "cursor", None)

    @_cursor.setter
    def _cursor(self, value: int | None) -> None:
        self._local.cursor = value

    def heads(self, seqs: list[BatchBranch]) -> int:
        """Heads of a batch's buffers: the model's K/V heads when grouped in the generator-first layout, else the
        query heads."""
        grouped = self.grouped and self.layout == "lengths" and all(s.kv.key_mask is None for s in seqs)
        return self.config.num_key_value_heads if grouped else self.config.num_attention_heads

    def elements(self, kinds: list[list[BatchBranch]]) -> int:
        """The arena elements of one loop's batches `kinds` (each its own Generator length: a transfer batch's
        no-control pass is shorter)."""
        return sum(step_buffer_elements(sequences=len(seqs), heads=self.heads(seqs),
                                        kv_heads=seqs[0].kv.keys[0].shape[1], prefix=max(s.kv.length for s in seqs),
                                        generator=seqs[0].rope.cos.shape[1], head_dim=self.config.head_dim,
                                        layers=self.config.num_hidden_layers, shared=self.shared)
                   for seqs in kinds)

    def reserve(self, kinds: list[list[BatchBranch]], at_least: int = 0) -> torch.Tensor:
        """The arena, grown (replaced) when `kinds` need more than it holds (or than `at_least` elements, a memory
        plan's size for the largest loop, so that it is allocated once). Graphs captured on the old one keep it alive
        through their own reference: warm the largest batch first, or reserve the plan's size."""
        need = max(self.elements(kinds), at_least)
        if self.arena is None or self.arena.numel() < need:
            self.arena = None
            self.arena = torch.empty(need, device=self.device, dtype=kinds[0][0].kv.keys[0].dtype)
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
        layers, kv_heads = len(seqs[0].kv.keys), seqs[0].kv.keys[0].shape[1]
        start = 0 if generator_first else umax
        # Every layer's prefix in one copy per sequence (its heads repeated for GQA by broadcasting) and the padding
        # in one fill: per-layer pads, cats and copies were ~330 kernels and ~1 ms of an Edge E7 replay
        # (bench/results/latency/2026-12-03-1bdd8a5-edges/).
        if self.shared:  # the prefixes at the K/V heads, [L, 2, S, K, Umax, d]; KVBuffers.layer copies them in
            n_pair = 2 * math.prod(shape)
            flat = self._take(n_pair + layers * 2 * len(seqs) * kv_heads * umax * self.config.head_dim, seqs)
            work = flat[:n_pair].view(2, *shape)
            held = flat[n_pair:].view(layers, 2, len(seqs), kv_heads, umax, self.config.head_dim)
            first, at_prefix = 0, g_len if generator_first else 0
        else:  # [L, 2 (k, v), S, H, T, d], the prefixes in place
            held = self._take(layers * 2 * math.prod(shape), seqs).view(layers, 2, *shape)
            first = at_prefix = g_len if generator_first else 0
        for row, (seq, pad) in enumerate(zip(seqs, pads, strict=True)):
            src = kv_storage(seq.kv)[:, :, 0]  # [L, 2, K, U, d]
            at = first if generator_first else pad
            dst = held[:, :, row, :, at : at + seq.kv.length]
            dst.unflatten(2, (kv_heads, held.shape[3] // kv_heads)).copy_(src.unsqueeze(3))
            if pad:
                zeros = slice(first + seq.kv.length, first + umax) if generator_first else slice(0, pad)
                held[:, :, row, :, zeros].zero_()
        if self.shared:
            bufs = KVBuffers([work[0]] * layers, [work[1]] * layers, start, work=work, prefixes=held,
                             prefix_at=at_prefix)
        else:
            bufs = KVBuffers(list(held[:, 0].unbind(0)), list(held[:, 1].unbind(0)), start)
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

    def _take(self, n: int, seqs: list[BatchBranch]) -> torch.Tensor:
        """n elements: the next ones of the arena while this thread allocates, else a fresh tensor."""
        cursor = self._cursor
        if cursor is None:
            return seqs[0].kv.keys[0].new_empty(n)
        self._cursor = cursor + n
        assert self.arena is not None and cursor + n <= self.arena.numel(), "arena too small"
        return self.arena[cursor : cursor + n]
