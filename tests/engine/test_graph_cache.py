"""The CUDA-graph cache on its own: LRU by count and by bytes, counters, and which bucket serves which batch."""

from __future__ import annotations

import pytest

from wamrt.engine.graph_cache import CapturedGraph, GraphCache, GraphKey

SAMPLER = ((999.0, 500.0), (True, True), 3.0, "unipc", 8, "droid")


def key(batch: int, width: int = 448, *, cfg: bool = True, bucketed: bool = True, sampler=SAMPLER) -> GraphKey:
    return GraphKey(batch, (48, 9, 16, 18), (33, 64), (width,) * (batch * (2 if cfg else 1)), sampler, bucketed)


def entry(nbytes: int = 0, seconds: float = 0.5) -> CapturedGraph:
    return CapturedGraph(nbytes=nbytes, seconds=seconds)


def test_lru_by_count_counts_evictions_and_keeps_the_newest():
    cache = GraphCache(max_entries=2)
    for b in (1, 2, 3):
        cache.add(key(b), entry())
    assert list(cache) == [key(2), key(3)] and cache.evictions == 1 and cache.captures == 3
    assert cache.get(key(2)) is not None  # touched: key(3) is now the least recently used
    cache.add(key(4), entry())
    assert list(cache) == [key(2), key(4)] and cache.evictions == 2


def test_lru_by_bytes_never_evicts_the_entry_just_added():
    cache = GraphCache(max_entries=10, max_bytes=100)
    cache.add(key(1), entry(nbytes=60))
    cache.add(key(2), entry(nbytes=60))  # 120 > 100: the older one goes
    assert list(cache) == [key(2)] and cache.nbytes == 60 and cache.evictions == 1
    cache.add(key(3), entry(nbytes=500))  # over the bound alone: still kept, so the request runs
    assert list(cache) == [key(3)]
    stats = cache.stats()
    assert stats == {"captures": 3, "entries": 1, "bytes": 500, "evictions": 2, "compatible_hits": 0,
                     "capture_seconds": [0.5, 0.5, 0.5],
                     "captures_by_cause": {"request": 3, "warmup": 0, "background": 0},
                     "requests": {"exact": 0, "wider": 0, "split": 0, "eager": 0, "waited": 0}}


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="graph_cache_size"):
        GraphCache(max_entries=0)
    with pytest.raises(ValueError, match="graph_cache_bytes"):
        GraphCache(max_entries=1, max_bytes=-1)


def test_a_larger_or_wider_bucket_serves_a_batch_and_the_cheapest_is_chosen():
    assert key(4).serves(key(2)) and key(4, 512).serves(key(4, 448))
    assert not key(2).serves(key(4))  # fewer rows
    assert not key(4, 384).serves(key(4, 448))  # narrower prefixes
    assert not key(4, cfg=False).serves(key(2))  # another branch structure (no CFG)
    assert not key(4, sampler=SAMPLER[:2] + (1.0,) + SAMPLER[3:]).serves(key(2))  # another sampler
    assert not key(4, bucketed=False).serves(key(2, bucketed=False))  # exact lengths: nothing to pad with
    cache = GraphCache(max_entries=8)
    for k in (key(8), key(4, 512), key(4), key(2)):
        cache.add(k, entry())
    assert cache.compatible(key(3)) == key(4)  # fewest rows first, then the narrowest width
    assert cache.compatible(key(3, 500)) == key(4, 512)
    assert cache.compatible(key(9)) is None
    assert cache.compatible_hits == 2
    assert key(4).describe() == {"batch": 4, "prefix_width": 448, "latent": [48, 9, 16, 18], "steps": 2,
                                 "cfg_steps": 2}


def test_a_batch_without_a_large_enough_bucket_splits_over_smaller_ones():
    """`split`: the largest captured bucket the requests left fill first, the last chunk padded up to the smallest
    that holds it; only buckets that serve one request of the batch (wide enough, same sampler); None without any."""
    cache = GraphCache(max_entries=8)
    assert cache.split(key(3)) is None
    cache.add(key(1, 512), entry())
    assert cache.split(key(3)) == [(1, key(1, 512))] * 3
    cache.add(key(2), entry())
    cache.add(key(4, 384), entry())  # too narrow for a 448-wide batch
    assert cache.split(key(7)) == [(2, key(2)), (2, key(2)), (2, key(2)), (1, key(1, 512))]
    assert cache.split(key(3)) == [(2, key(2)), (1, key(1, 512))]
    assert cache.split(key(3, 384)) == [(3, key(4, 384))]
    assert cache.split(key(3, 600)) is None
    assert cache.split(key(2, cfg=False)) is None  # another branch structure


def test_keys_for_other_batch_sizes_and_counters_by_cause():
    assert key(4).rows(2) == key(2) and key(1, 512).rows(8) == key(8, 512)
    assert key(2, cfg=False).rows(4) == key(4, cfg=False)
    cache = GraphCache(max_entries=4)
    cache.add(key(1), CapturedGraph(cause="background", pool=("p", 1)))
    cache.add(key(2), CapturedGraph(cause="warmup", pool=("p", 1)))
    cache.count("split", 3)
    stats = cache.stats()
    assert stats["captures_by_cause"] == {"request": 0, "warmup": 1, "background": 1}
    assert stats["requests"]["split"] == 3 and cache.pools() == {("p", 1)}
