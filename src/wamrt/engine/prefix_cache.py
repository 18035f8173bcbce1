"""Reasoner K/V kept per prompt: computed once (the Reasoner is causal text, so an instruction's K/V never
changes), padded once per prompt bucket, stacked per batch."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..model import Cosmos3Transformer, ReasonerKV


class ReasonerCache:
    """LRU of per-prompt Reasoner K/V. Text positions are 0..U-1 whatever the image geometry, so the
    token ids alone identify an entry."""

    def __init__(self, model: Cosmos3Transformer, size: int) -> None:
        self.model, self.size = model, size
        self.entries: OrderedDict[tuple[int, ...], ReasonerKV] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, ids: torch.Tensor, positions: torch.Tensor, key: tuple[int, ...] | None = None) -> ReasonerKV:
        """The entry of ids [1, U]; `key`: the same ids as a host tuple, if the caller has them (no read-back)."""
        key = tuple(ids[0].tolist()) if key is None else key
        kv = self.entries.get(key)
        if kv is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return kv
        self.misses += 1
        rope_und, _ = self.model.rope(positions).split(ids.shape[1])
        kv = self.model.prefill_reasoner(ids, rope_und)
        self.entries[key] = kv
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return kv


class PaddedPrefixes:
    """Left-zero-padded copies of cached Reasoner K/V per (entry, width), with the key mask of the real tokens:
    an episode repeating its instruction pads once, not on every request. Zeros, not garbage: a masked key's
    value still enters the kernel's arithmetic. The entry itself is kept to check identity (ids are reused)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.entries: OrderedDict[tuple[int, int], tuple[ReasonerKV, ReasonerKV]] = OrderedDict()

    def get(self, kv: ReasonerKV, width: int) -> ReasonerKV:
        key = (id(kv), width)
        hit = self.entries.get(key)
        if hit is not None and hit[0] is kv:
            self.entries.move_to_end(key)
            return hit[1]
        pad = width - kv.length
        if pad < 0:
            raise ValueError(f"cannot pad a {kv.length}-token prefix to {width}")
        padded = ReasonerKV([torch.nn.functional.pad(k, (0, 0, pad, 0)) for k in kv.keys],
                            [torch.nn.functional.pad(v, (0, 0, pad, 0)) for v in kv.values],
                            key_mask=(torch.arange(width, device=self.device) >= pad)[None])
        self.entries[key] = (kv, padded)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return padded


def pad_kv(kvs: list[ReasonerKV], *, front: bool = True
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Stack per-sequence K/V [1, K, U_s, d] into [S, K, Umax, d], zero padding at the front (or at the back), and
    each sequence's padding length."""
    longest = max(kv.length for kv in kvs)
    pads = [longest - kv.length for kv in kvs]

    def padded(t: torch.Tensor, n: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, n, 0) if front else (0, 0, 0, n))

    keys, values = [], []
    for layer in range(len(kvs[0].keys)):
        keys.append(torch.cat([padded(kv.keys[layer], n) for kv, n in zip(kvs, pads, strict=True)]))
        values.append(torch.cat([padded(kv.values[layer], n) for kv, n in zip(kvs, pads, strict=True)]))
    return keys, values, pads
