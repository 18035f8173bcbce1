"""Reasoner K/V in one storage (`StackedKV`): the prefix cache's entries, padded prefixes, graph-input copies."""

from __future__ import annotations

import torch

from wamrt.engine.prefix_cache import PaddedPrefixes, StackedKV, copy_lists, kv_storage
from wamrt.model import ReasonerKV

LAYERS, KV_HEADS, DIM = 3, 2, 4


def make_kv(length: int, seed: int, mask: bool = False) -> ReasonerKV:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, KV_HEADS, length, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, length, DIM, generator=g) for _ in range(LAYERS)]
    return ReasonerKV(keys, values, torch.ones(1, length, dtype=torch.bool) if mask else None)


def test_stacked_kv_holds_the_same_layers_as_views_of_one_storage():
    kv = make_kv(5, 0)
    stacked = StackedKV.of(kv)
    assert stacked.storage is not None and stacked.storage.shape == (LAYERS, 2, 1, KV_HEADS, 5, DIM)
    for mine, theirs in zip(stacked.keys + stacked.values, kv.keys + kv.values, strict=True):
        assert torch.equal(mine, theirs)
        assert mine.untyped_storage().data_ptr() == stacked.storage.untyped_storage().data_ptr()
    assert StackedKV.of(stacked) is stacked and stacked.length == 5
    twin = stacked.clone()
    twin.keys[1].zero_()  # a clone's layers are its own
    assert torch.equal(stacked.keys[1], kv.keys[1]) and not torch.equal(twin.keys[1], kv.keys[1])
    assert torch.equal(kv_storage(kv), stacked.storage)


def test_copy_lists_moves_one_storage_when_both_sides_are_stacked_alike():
    a, b = StackedKV.of(make_kv(5, 0, mask=True)), StackedKV.of(make_kv(5, 1, mask=True))
    out, into = copy_lists(a, b)
    assert [t.shape for t in out] == [a.storage.shape, (1, 5)] and len(into) == 2
    torch._foreach_copy_(out, into)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))
    out, into = copy_lists(StackedKV.of(make_kv(5, 2)), make_kv(5, 3))  # a source not stacked: every layer, no masks
    assert len(out) == len(into) == 2 * LAYERS


def test_padded_prefixes_are_stacked_and_left_padded_with_zeros():
    kv = StackedKV.of(make_kv(3, 0))
    padded = PaddedPrefixes(4, torch.device("cpu")).get(kv, 5)
    assert isinstance(padded, StackedKV) and padded.length == 5
    assert torch.equal(padded.key_mask, torch.tensor([[False, False, True, True, True]]))
    for layer in range(LAYERS):
        assert torch.equal(padded.keys[layer][:, :, :2], torch.zeros(1, KV_HEADS, 2, DIM))
        assert torch.equal(padded.values[layer][:, :, 2:], kv.values[layer])
