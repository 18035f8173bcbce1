"""Reasoner K/V kept per prompt: computed once (the Reasoner is causal text, so an instruction's K/V never
changes), padded once per prompt bucket, each entry's layers in one storage (`StackedKV`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model import Cosmos3Transformer, ReasonerKV


@dataclass
class StackedKV(ReasonerKV):
    """A ReasonerKV whose per-layer keys and values are views of one tensor, `storage` [L, 2 (k, v), B, K, U, d].
    A captured graph's prefix then travels in one copy: host -> its static input and, inside the graph, static input
    -> its K/V buffers (`KVBufferArena.buffers`). Per-layer copies were ~330 kernels and ~1 ms at the start of every
    Edge E7 replay (bench/results/latency/2026-12-03-1ba1cea-fast-accum/, run2's trace)."""

    storage: torch.Tensor | None = None

    @classmethod
    def of(cls, kv: ReasonerKV) -> StackedKV:
        """`kv` in one storage (a copy, unless it is stacked already)."""
        if isinstance(kv, StackedKV):
            return kv
        return cls.over(kv_storage(kv), kv.key_mask)

    @classmethod
    def over(cls, storage: torch.Tensor, key_mask: torch.Tensor | None = None) -> StackedKV:
        return cls(list(storage[:, 0].unbind(0)), list(storage[:, 1].unbind(0)), key_mask, storage)

    def clone(self) -> StackedKV:
        assert self.storage is not None
        return StackedKV.over(self.storage.clone(), None if self.key_mask is None else self.key_mask.clone())


def kv_storage(kv: ReasonerKV) -> torch.Tensor:
    """[L, 2, B, K, U, d]: `kv`'s storage if it is a StackedKV, else its layers stacked (a copy)."""
    if isinstance(kv, StackedKV) and kv.storage is not None:
        return kv.storage
    return torch.stack([torch.stack(kv.keys), torch.stack(kv.values)], dim=1)


def copy_lists(dst: ReasonerKV, src: ReasonerKV) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors that copy `src`'s K/V (and key mask) into `dst`'s, for `torch._foreach_copy_`: one storage each
    when both are stacked alike, else every layer's keys and values."""
    if (isinstance(dst, StackedKV) and isinstance(src, StackedKV) and dst.storage is not None
            and src.storage is not None and dst.storage.shape == src.storage.shape):
        out, into = [dst.storage], [src.storage]
    else:
        out, into = dst.keys + dst.values, src.keys + src.values
    if dst.key_mask is not None:
        assert src.key_mask is not None
        out, into = out + [dst.key_mask], into + [src.key_mask]
    return out, into


def kv_nbytes(kv: ReasonerKV) -> int:
    storage = kv_storage(kv) if isinstance(kv, StackedKV) else None
    if storage is not None:
        return storage.numel() * storage.element_size()
    return sum(t.numel() * t.element_size() for t in kv.keys + kv.values)


class _BoundedLRU:
    """An LRU bounded by entries and (when max_bytes > 0) by the bytes of its values; never evicts the newest.
    Locked: a background capture pads prefixes while the request path looks them up."""

    def __init__(self, size: int, max_bytes: int = 0) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.entries: OrderedDict = OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    def _lookup(self, key):
        with self._lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
            return hit

    def _insert(self, key, value, nbytes: int) -> None:
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self.entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while len(self.entries) > 1 and (len(self.entries) > self.size
                                             or (self.max_bytes and self.nbytes > self.max_bytes)):
                _, (_, dropped) = self.entries.popitem(last=False)
                self.nbytes -= dropped


class ReasonerCache(_BoundedLRU):
    """LRU of per-prompt Reasoner K/V. Text positions are 0..U-1 whatever the image geometry, so the
    token ids alone identify an entry."""

    def __init__(self, model: Cosmos3Transformer, size: int, max_bytes: int = 0) -> None:
        super().__init__(size, max_bytes)
        self.model = model
        self.hits = self.misses = 0

    def get(self, ids: torch.Tensor, positions: torch.Tensor, key: tuple[int, ...] | None = None) -> ReasonerKV:
        """The entry of ids [1, U]; `key`: the same ids as a host tuple, if the caller has them (no read-back)."""
        key = tuple(ids[0].tolist()) if key is None else key
        hit = self._lookup(key)
        if hit is not None:
            self.hits += 1
            return hit[0]
        self.misses += 1
        rope_und, _ = self.model.rope(positions).split(ids.shape[1])
        kv = StackedKV.of(self.model.prefill_reasoner(ids, rope_und))
        self._insert(key, kv, kv_nbytes(kv))
        return kv


class PaddedPrefixes(_BoundedLRU):
    """Left-zero-padded copies of cached Reasoner K/V per (entry, width), with the key mask of the real tokens:
    an episode repeating its instruction pads once, not on every request. Zeros, not garbage: a masked key's
    value still enters the kernel's arithmetic. The entry itself is kept to check identity (ids are reused)."""

    def __init__(self, size: int, device: torch.device, max_bytes: int = 0) -> None:
        super().__init__(size, max_bytes)
        self.device = device

    def get(self, kv: ReasonerKV, width: int) -> ReasonerKV:
        key = (id(kv), width)
        hit = self._lookup(key)
        if hit is not None and hit[0][0] is kv:
            return hit[0][1]
        pad = width - kv.length
        if pad < 0:
            raise ValueError(f"cannot pad a {kv.length}-token prefix to {width}")
        padded = StackedKV.over(torch.nn.functional.pad(kv_storage(kv), (0, 0, pad, 0)),
                                key_mask=(torch.arange(width, device=self.device) >= pad)[None])
        self._insert(key, (kv, padded), kv_nbytes(padded))
        return padded
