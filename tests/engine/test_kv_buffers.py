"""`KVBufferArena`: a batch's K/V buffers (every layer's prefix in one copy per sequence) and the arena they come from
while a graph is captured."""

from __future__ import annotations

import pytest
import torch

from wamrt.engine.kv_buffers import BatchBranch, KVBufferArena
from wamrt.engine.prefix_cache import StackedKV
from wamrt.engine.qkv_epilogue import repeat_heads
from wamrt.model import ReasonerKV, Rope
from wamrt.ops.attention import KeyLengthAttention, PrefixOffsetAttention

LAYERS, KV_HEADS, HEADS, DIM, G_LEN = 3, 2, 4, 4, 6


def make_kv(length: int, seed: int) -> ReasonerKV:
    g = torch.Generator().manual_seed(seed)
    return ReasonerKV([torch.randn(1, KV_HEADS, length, DIM, generator=g) for _ in range(LAYERS)],
                      [torch.randn(1, KV_HEADS, length, DIM, generator=g) for _ in range(LAYERS)])


def branch(request: int, kv: ReasonerKV) -> BatchBranch:
    return BatchBranch(request, kv, Rope(torch.ones(1, G_LEN, DIM), torch.zeros(1, G_LEN, DIM)))


def make_arena(layout: str, grouped: bool, shared: bool = False) -> KVBufferArena:
    config = type("Config", (), dict(head_dim=DIM, num_key_value_heads=KV_HEADS, num_attention_heads=HEADS,
                                     num_hidden_layers=LAYERS))()
    return KVBufferArena(config, torch.device("cpu"), layout=layout, grouped=grouped, backend="auto",  # type: ignore[arg-type]
                         bucket_attention="lse", rescale=lambda *a: a[0], shared=shared)


@pytest.mark.parametrize("layout", ["split", "lengths"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared"])
def test_buffers_hold_each_prefix_padded_and_head_repeated(layout, grouped, shared):
    """Against the per-layer construction the one-copy form replaced: zeros where a shorter prefix ends (in front of
    it, or after it generator-first), heads repeated for GQA unless grouped generator-first; a stacked and a plain
    ReasonerKV alike. Shared: one buffer pair for every layer, holding the layer's own prefixes once `layer(i)` is
    asked for, whatever a previous layer (or the Generator's stores) left in it."""
    arena = make_arena(layout, grouped, shared)
    seqs = [branch(0, StackedKV.of(make_kv(5, 0))), branch(0, make_kv(2, 1))]
    bufs, rope, attn = arena.buffers(seqs)
    generator_first, umax = layout == "lengths", 5
    heads = KV_HEADS if grouped and generator_first else HEADS
    assert isinstance(attn, KeyLengthAttention if generator_first else PrefixOffsetAttention)
    assert bufs.start == (0 if generator_first else umax) and rope.cos.shape == (2, G_LEN, DIM)
    assert (len({t.data_ptr() for t in bufs.keys}) == 1) == shared
    for layer in range(LAYERS):
        if shared:
            bufs.work[:, :, :, bufs.prefix_at : bufs.prefix_at + umax].fill_(float("nan"))  # the previous layer's
        keys, values = bufs.layer(layer)
        for got, which in ((keys, "keys"), (values, "values")):
            assert got.shape == (2, heads, umax + G_LEN, DIM)
            for row, seq in enumerate(seqs):
                n = seq.kv.length
                want = repeat_heads(getattr(seq.kv, which)[layer], heads)[0]
                if generator_first:
                    assert torch.equal(got[row, :, G_LEN : G_LEN + n], want)
                    assert not got[row, :, G_LEN + n : G_LEN + umax].any()
                else:
                    assert torch.equal(got[row, :, umax - n : umax], want)
                    assert not got[row, :, : umax - n].any()


@pytest.mark.parametrize("shared", [False, True], ids=["per-layer", "shared"])
def test_allocating_takes_the_same_arena_regions_on_every_rewound_run(shared):
    """While allocating, buffers are views of the arena, and a rewound run (the next warm-up, the capture) takes the
    same regions; outside it they are fresh tensors. The arena grows for a larger loop and is sized by `elements`:
    per layer L buffer pairs, shared one pair and the prefixes at the K/V heads."""
    arena = make_arena("split", grouped=False, shared=shared)
    batches = [[branch(0, make_kv(5, 0)), branch(0, make_kv(2, 1))]]
    held = arena.reserve(batches)
    pair = 2 * 2 * HEADS * (5 + G_LEN) * DIM
    want = pair + LAYERS * 2 * 2 * KV_HEADS * 5 * DIM if shared else LAYERS * pair
    assert held.shape == (arena.elements(batches),) == (want,)
    with arena.allocating():
        first = arena.buffers(batches[0])[0]
        arena.rewind()
        again = arena.buffers(batches[0])[0]
        with pytest.raises(AssertionError, match="arena too small"):
            arena.buffers(batches[0])
    assert first.keys[1].data_ptr() == again.keys[1].data_ptr()
    assert first.keys[0].untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    fresh = arena.buffers(batches[0])[0]
    assert fresh.keys[0].untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    assert arena.reserve(batches) is held  # big enough: kept
    longer = [[branch(0, make_kv(9, 2)), branch(0, make_kv(2, 1))]]
    assert arena.reserve(longer).numel() > held.numel()
    assert arena.reserve(longer, at_least=10 * want).numel() == 10 * want  # a plan's size: allocated once


def test_each_thread_allocates_from_its_own_cursor():
    """A background capture holds the arena cursor on its own thread: the request path, meanwhile, gets fresh
    buffers, never a region a captured graph replays over."""
    import threading

    arena = make_arena("split", grouped=False, shared=True)
    batches = [[branch(0, make_kv(5, 0))]]
    held = arena.reserve(batches)
    other: list = []
    with arena.allocating():
        t = threading.Thread(target=lambda: other.append(arena.buffers(batches[0])[0]))
        t.start()
        t.join()
        mine = arena.buffers(batches[0])[0]
    assert mine.keys[0].untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    assert other[0].keys[0].untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
