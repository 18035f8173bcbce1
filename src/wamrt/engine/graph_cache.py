"""Captured denoising loops, one per shape bucket: an LRU bounded by count and by bytes, with the counters a
server exports (captures, evictions, capture seconds) and the lookup of a compatible bucket.

A bucket is compatible with a batch when only its size differs in the batch's favour: at least as many
requests and, with prompt buckets, a prefix width at least as wide. The batch then replays that graph with
copies of its last request in the spare rows and its prefixes padded to the wider width (masked keys), so a
new mix of requests never waits for a capture (7-23 s at Nano) once warm-up has captured the large buckets.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


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
    nbytes: int = 0  # device memory the capture added (graph pool and K/V arena growth)
    seconds: float = 0.0  # wall time of warm-up + capture


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

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def get(self, key: GraphKey) -> CapturedGraph | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def compatible(self, key: GraphKey) -> GraphKey | None:
        """The cheapest captured bucket that serves `key` (fewest rows, then narrowest), or None."""
        found = [k for k in self.entries if k.serves(key)]
        if not found:
            return None
        best = min(found, key=lambda k: (k.batch, k.width))
        self.entries.move_to_end(best)
        self.compatible_hits += 1
        return best

    def add(self, key: GraphKey, entry: CapturedGraph) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        self.captures += 1
        self.capture_seconds.append(entry.seconds)
        while len(self.entries) > 1 and (len(self.entries) > self.max_entries
                                         or (self.max_bytes and self.nbytes > self.max_bytes)):
            self.entries.popitem(last=False)
            self.evictions += 1

    def stats(self) -> dict[str, Any]:
        return {"captures": self.captures, "entries": len(self.entries), "bytes": self.nbytes,
                "evictions": self.evictions, "compatible_hits": self.compatible_hits,
                "capture_seconds": list(self.capture_seconds)}


def device_bytes_in_use(device: torch.device) -> int:
    """Memory the caching allocator holds on `device` (reserved, so graph-pool growth counts); 0 on the CPU."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0


class CaptureTimer:
    """Wall time and device-memory growth of one capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> CaptureTimer:
        self.t0, self.b0 = time.perf_counter(), device_bytes_in_use(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.nbytes = max(0, device_bytes_in_use(self.device) - self.b0)
