"""Captured denoising loops, one per shape bucket: an LRU bounded by count and by bytes, with the counters a
server exports (captures by cause, evictions, capture seconds, how each request ran) and the lookup of a compatible
bucket or of several smaller ones.

A bucket is compatible with a batch when only its size differs in the batch's favour: at least as many
requests and, with prompt buckets, a prefix width at least as wide. The batch then replays that graph with
copies of its last request in the spare rows and its prefixes padded to the wider width (masked keys), so a
new mix of requests never waits for a capture (7-35 s at Nano). Without one, the batch may run as a sequence
of replays of smaller captured buckets (`split`). Every graph shares one memory pool (they replay one at a time
on one stream); `graph_pool_bytes` reads its size from the allocator.

Thread-safe: a background capture adds entries while the request path looks them up.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch


def ladder_rung(batch: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest rung of a batch ladder that holds `batch` rows; None past its top (or without one)."""
    return min((b for b in ladder if b >= batch), default=None)


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph was specialised on. `lengths`: the Reasoner prefix length of every sequence
    (conds, then unconds) in batch order; with prompt buckets they are all one padded width."""

    batch: int
    vision: tuple[int, ...]  # latent shape without the batch dimension
    action: tuple[int, ...]
    lengths: tuple[int, ...]
    sampler: tuple  # timesteps, CFG pattern, guidance, solver, raw action dim, contract
    bucketed: bool

    @property
    def width(self) -> int:
        return max(self.lengths)

    def rows(self, batch: int) -> GraphKey:
        """The key of `batch` requests of this bucket (prompt buckets: every sequence at one width)."""
        per_request = len(self.lengths) // self.batch
        return replace(self, batch=batch, lengths=(self.width,) * (per_request * batch))

    def serves(self, wanted: GraphKey) -> bool:
        """Can a batch of `wanted` replay this graph (spare rows and wider, masked prefixes)?"""
        if not (self.bucketed and wanted.bucketed) or (self.vision, self.action, self.sampler) != (
                wanted.vision, wanted.action, wanted.sampler):
            return False
        # Same branch structure: as many sequences per request (1 without CFG, 2 with).
        if len(self.lengths) * wanted.batch != len(wanted.lengths) * self.batch:
            return False
        return self.batch >= wanted.batch and self.width >= wanted.width

    def describe(self) -> dict[str, Any]:
        timesteps, cfg_steps = self.sampler[0], self.sampler[1]
        return {"batch": self.batch, "prefix_width": self.width if self.bucketed else list(self.lengths),
                "latent": list(self.vision), "steps": len(timesteps), "cfg_steps": sum(cfg_steps)}


@dataclass
class CapturedGraph:
    """A captured denoising loop plus the static buffers it reads and writes."""

    graph: Any = None  # torch.cuda.CUDAGraph, made by Engine._record
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None
    keepalive: tuple = ()
    nbytes: int = 0  # device memory evicting it frees: its static inputs and outputs (the pool and arena are shared)
    seconds: float = 0.0  # wall time of warm-up + capture
    pool: Any = None  # the memory pool it was captured in (every graph of an engine: the same one)
    cause: str = "request"  # "request" (a request waited for it), "warmup" or "background"


class GraphCache:
    """LRU of captured graphs. `max_entries` and `max_bytes` (0: unbounded) bound it; the entry just added
    is never evicted, so one over-sized graph still runs."""

    def __init__(self, max_entries: int, max_bytes: int = 0) -> None:
        if max_entries < 1:
            raise ValueError(f"graph_cache_size must be >= 1, got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"graph_cache_bytes must be >= 0, got {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[GraphKey, CapturedGraph] = OrderedDict()
        self.captures = self.evictions = self.compatible_hits = 0
        self.capture_seconds: list[float] = []
        self.captures_by_cause: Counter[str] = Counter()
        # How each request's denoising loop ran: "exact" (its bucket's graph), "wider" (a captured bucket with more
        # rows or a wider prefix), "split" (replays of smaller captured buckets), "eager" (no graph: uncaptured),
        # "waited" (its batch waited for a capture on the request path)
        self.requests: Counter[str] = Counter()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[GraphKey]:
        with self._lock:
            return iter(list(self.entries))

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self.entries.values())

    def pools(self) -> set[Any]:
        """The memory pools the held graphs were captured in (one when they share it)."""
        with self._lock:
            return {e.pool for e in self.entries.values()}

    def get(self, key: GraphKey) -> CapturedGraph | None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
            return entry

    def compatible(self, key: GraphKey) -> GraphKey | None:
        """The cheapest captured bucket that serves `key` (fewest rows, then narrowest), or None."""
        with self._lock:
            found = [k for k in self.entries if k.serves(key)]
            if not found:
                return None
            best = min(found, key=lambda k: (k.batch, k.width))
            self.entries.move_to_end(best)
            self.compatible_hits += 1
            return best

    def split(self, key: GraphKey) -> list[tuple[int, GraphKey]] | None:
        """Captured buckets whose replays, one after the other, serve `key`'s requests: (requests, bucket) pairs,
        the largest bucket that the requests left fill first, the last one padded up; None when no captured bucket
        serves even one of them."""
        with self._lock:
            fit = [k for k in self.entries if k.serves(key.rows(1))]
            if not fit:
                return None
            chunks, left = [], key.batch
            while left:
                covering = [k for k in fit if k.batch >= left]
                if covering:
                    chunks.append((left, min(covering, key=lambda k: (k.batch, k.width))))
                    break
                best = max(fit, key=lambda k: (k.batch, -k.width))
                chunks.append((best.batch, best))
                left -= best.batch
            for _, k in chunks:
                self.entries.move_to_end(k)
            return chunks

    def compatible_entry(self, key: GraphKey) -> tuple[GraphKey, CapturedGraph] | None:
        """`compatible`, with its entry held: a background capture may evict the bucket before it replays."""
        with self._lock:
            found = self.compatible(key)
            return None if found is None else (found, self.entries[found])

    def split_entries(self, key: GraphKey) -> list[tuple[int, GraphKey, CapturedGraph]] | None:
        """`split`, with each bucket's entry held."""
        with self._lock:
            chunks = self.split(key)
            return None if chunks is None else [(n, k, self.entries[k]) for n, k in chunks]

    def add(self, key: GraphKey, entry: CapturedGraph) -> None:
        with self._lock:
            self.entries[key] = entry
            self.entries.move_to_end(key)
            self.captures += 1
            self.captures_by_cause[entry.cause] += 1
            self.capture_seconds.append(entry.seconds)
            while len(self.entries) > 1 and (len(self.entries) > self.max_entries
                                             or (self.max_bytes and self.nbytes > self.max_bytes)):
                self.entries.popitem(last=False)
                self.evictions += 1

    def count(self, how: str, requests: int) -> None:
        with self._lock:
            self.requests[how] += requests

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"captures": self.captures, "entries": len(self.entries), "bytes": self.nbytes,
                    "evictions": self.evictions, "compatible_hits": self.compatible_hits,
                    "capture_seconds": list(self.capture_seconds),
                    "captures_by_cause": {c: self.captures_by_cause[c] for c in CAPTURE_CAUSES},
                    "requests": {h: self.requests[h] for h in REQUEST_PATHS}}


CAPTURE_CAUSES = ("request", "warmup", "background")
REQUEST_PATHS = ("exact", "wider", "split", "eager", "waited")


def tensor_bytes(*tensors: Any) -> int:
    """Bytes of the distinct storages among `tensors` (nested lists, tuples and dicts walked; others ignored)."""
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name))

    walk(tensors)
    return sum(seen.values())


def graph_pool_bytes(device: torch.device, pool: Any) -> int:
    """What the caching allocator holds in memory pool `pool` on `device` (its segments' sizes); 0 on the CPU or
    without a pool. The allocator's own figure, not an estimate."""
    if device.type != "cuda" or pool is None:
        return 0
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)  # type: ignore[call-arg]
    except TypeError:  # an older torch: no keyword
        segments = torch.cuda.memory_snapshot()
    want = tuple(pool)
    return sum(int(s["total_size"]) for s in segments
               if s.get("device") == (device.index or 0) and tuple(s.get("segment_pool_id", ())) == want)


def device_memory_stats(device: torch.device) -> dict[str, int]:
    """The caching allocator's reserved, allocated and peak reserved bytes on `device` ({} on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"reserved": int(torch.cuda.memory_reserved(device)), "allocated": int(torch.cuda.memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device))}


class CaptureTimer:
    """Wall time of one capture, and how much the graph pool grew."""

    def __init__(self, device: torch.device, pool: Any = None) -> None:
        self.device, self.pool = device, pool

    def __enter__(self) -> CaptureTimer:
        self.t0, self.b0 = time.perf_counter(), graph_pool_bytes(self.device, self.pool)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.pool_growth = max(0, graph_pool_bytes(self.device, self.pool) - self.b0)
