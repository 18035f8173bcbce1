"""Prometheus metrics, one registry per app (tests run several servers in one process): request and engine metrics,
`wamrt_build_info`, and the process metrics (memory, CPU, open files) prometheus_client's collectors read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..provenance import git_sha
from .heap import heap_stats

_CAPTURE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_git_sha = functools.cache(git_sha)  # a subprocess: once per process, not per app


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int) -> None:
        self.registry = r = CollectorRegistry()
        self.queue = Gauge("wamrt_queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_size = Histogram("wamrt_batch_size", "Requests per infer_batch call",
                                    buckets=tuple(range(1, max_batch + 1)), registry=r)
        self.batch_seconds = Histogram("wamrt_batch_seconds", "Wall time of one infer_batch call",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("wamrt_request_seconds", "Server-side request latency",
                                         ["surface"], buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Histogram("wamrt_stage_seconds", "Per-request stage latency",
                                       ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("wamrt_requests", "Requests answered", ["surface"], registry=r)
        self.errors = Counter("wamrt_errors", "Errors returned, by type", ["code"], registry=r)
        self.safety = Counter("wamrt_safety_interventions", "Chunks clamped or rejected", ["mode"], registry=r)
        self.build = Info("wamrt_build", "What this server runs: wamrt version, git commit, model, quantization recipe",
                          registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ... (Linux /proc)
        PlatformCollector(registry=r)  # python_info
        r.register(_HeapCollector())
        self.chat_first_token = Histogram("wamrt_chat_first_token_seconds", "Chat: queued -> first token (the wait "
                                          "for the device and the prefill)", buckets=_LATENCY_BUCKETS, registry=r)

    def build_info(self, *, version: str, model: str, recipe: str | None) -> None:
        self.build.info({"version": version, "git_sha": _git_sha(), "model": model, "recipe": recipe or "none"})

    # BatchObserver (called from the engine thread; prometheus_client is thread-safe)
    def queue_depth(self, depth: int) -> None:
        self.queue.set(depth)

    def batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def timing(self, surface: str, timing_ms: dict[str, float]) -> None:
        self.requests.labels(surface).inc()
        self.request_seconds.labels(surface).observe(timing_ms.get("total_ms", 0.0) / 1e3)
        for stage in ("queue_ms", "preprocess_ms", "model_ms", "postprocess_ms"):
            if stage in timing_ms:
                self.stage_seconds.labels(stage.removesuffix("_ms")).observe(timing_ms[stage] / 1e3)

    def watch_graphs(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Export the engine's CUDA-graph cache (`Engine.graph_stats`) on every scrape."""
        self.registry.register(_GraphCollector(stats))

    def watch_chat(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Export the Reasoner's decode thread (`ChatWorker.stats`) on every scrape."""
        self.registry.register(_ChatCollector(stats))

    def first_token(self, seconds: float) -> None:
        """A chat request's first token, `seconds` after it was queued (prefill and the wait for the device)."""
        self.chat_first_token.observe(seconds)

    def watch_generation(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Export the world-generation worker's counters (`GenerationWorker.stats`) on every scrape."""
        self.registry.register(_GenerationCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HeapCollector:
    """The C heap's own books (`heap.heap_stats`): what a leak grows, against what the allocator merely keeps."""

    def collect(self):
        stats = heap_stats()
        if stats is None:
            return
        yield GaugeMetricFamily("wamrt_heap_in_use_bytes", "C heap bytes in use (glibc mallinfo2: chunks in use "
                                "plus mmapped blocks)", value=stats["in_use"])
        yield GaugeMetricFamily("wamrt_heap_free_bytes", "C heap bytes freed but kept by the allocator",
                                value=stats["free"])


class _GraphCollector:
    """The engine's CUDA graphs, from its own counters (it owns the truth; no double books): captures (in all, and by
    cause), evictions, entries, how requests ran (wamrt_graph_requests_total{path}), the background captures'
    progress, device memory (the graph pool as the allocator reports it, the K/V arena, the static inputs; the
    allocator's peak) and the wamrt_graph_capture_seconds histogram."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield CounterMetricFamily("wamrt_graph_captures", "CUDA graphs captured, warm-up included", value=s["captures"])
        by_cause = CounterMetricFamily("wamrt_graph_captures_by_cause", "CUDA graphs captured: on the request path "
                                       "(a request waited), in warm-up, or in the background", labels=["cause"])
        for cause, n in (s.get("captures_by_cause") or {}).items():
            by_cause.add_metric([cause], n)
        yield by_cause
        paths = CounterMetricFamily("wamrt_graph_requests", "Requests by how their denoising loop ran: exact (its "
                                    "graph), wider (a graph with more rows or a wider prefix), split (replays of "
                                    "smaller graphs), eager (uncaptured, while its graph is captured), waited (for a "
                                    "capture on the request path)", labels=["path"])
        for path, n in (s.get("requests") or {}).items():
            paths.add_metric([path], n)
        yield paths
        yield CounterMetricFamily("wamrt_graph_evictions", "CUDA graphs evicted from the cache", value=s["evictions"])
        yield GaugeMetricFamily("wamrt_graph_cache_entries", "CUDA graphs held", value=s["entries"])
        pool, arena = s.get("pool_bytes", 0), s.get("arena_bytes", 0)
        yield GaugeMetricFamily("wamrt_graph_pool_bytes", "The memory pool every CUDA graph shares, as the allocator "
                                "reports its segments", value=pool)
        yield GaugeMetricFamily("wamrt_graph_arena_bytes", "The K/V step-buffer arena the CUDA graphs share",
                                value=arena)
        yield GaugeMetricFamily("wamrt_graph_cache_bytes", "Device memory of the held CUDA graphs: their shared pool "
                                "(allocator), the K/V arena and their static inputs", value=pool + arena + s["bytes"])
        capture = s.get("capture") or {}
        for name, doc in (("planned", "Buckets planned for capture (batch ladder x prefix widths)"),
                          ("captured", "Planned buckets captured"), ("pending", "Buckets waiting for a capture"),
                          ("failed", "Background captures that failed (their requests run uncaptured)")):
            if name in capture:
                yield GaugeMetricFamily(f"wamrt_graph_capture_{name}", doc, value=capture[name])
        for outcome, n in (s.get("out_of_memory") or {}).items():
            yield CounterMetricFamily(f"wamrt_out_of_memory_{outcome}", "Requests rerun alone after the device ran "
                                      "out of memory" if outcome == "retried" else "Requests answered out_of_memory",
                                      value=n)
        for name, value in (s.get("device") or {}).items():
            yield GaugeMetricFamily(f"wamrt_gpu_memory_{name}_bytes", f"The caching allocator's {name} bytes",
                                    value=value)
        secs = s["capture_seconds"]
        buckets = [(str(b), sum(x <= b for x in secs)) for b in _CAPTURE_BUCKETS] + [("+Inf", len(secs))]
        yield HistogramMetricFamily("wamrt_graph_capture_seconds", "Wall time of one capture (warm-up + record)",
                                    buckets=buckets, sum_value=sum(secs))


class _ChatCollector:
    """wamrt_chat_requests_total, _tokens_total, _steps_total (decode steps, every live request a token each),
    _device_seconds_total (tokens over it: the decode rate), _segment_max_seconds (a policy request's worst wait
    behind chat), _running and _queued, the decode graphs captured ahead of use and on a request's step, from the
    decode thread's own counters."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, text in (("requests", "Chat and upsampling requests admitted"), ("tokens", "Tokens decoded"),
                           ("steps", "Decode steps"), ("device_seconds", "Device time the Reasoner held")):
            yield CounterMetricFamily(f"wamrt_chat_{name}", text, value=s[name])
        yield GaugeMetricFamily("wamrt_chat_segment_max_seconds", "Longest device segment of the Reasoner so far",
                                value=s["segment_max_seconds"])
        yield GaugeMetricFamily("wamrt_chat_running", "Chat requests decoding", value=s["running"])
        yield GaugeMetricFamily("wamrt_chat_queued", "Chat requests waiting for a row", value=s["queued"])
        g = s["graphs"]
        yield GaugeMetricFamily("wamrt_chat_graphs_planned", "Decode-graph buckets to capture while idle",
                                value=g["planned"])
        yield CounterMetricFamily("wamrt_chat_graphs_precaptured", "Decode graphs captured while idle",
                                  value=g["precaptured"])
        yield CounterMetricFamily("wamrt_chat_graphs_captured_on_request", "Decode graphs a chat step had to "
                                  "capture (its bucket was not captured ahead)", value=g["captured_on_request"])


class _GenerationCollector:
    """wamrt_generation_jobs_total, _segments_total, _device_seconds_total (device time generation held, between
    its yield points), _segment_max_seconds (the longest such stretch: a policy request's worst wait for the
    device), _running and _queued, from the worker's own counters."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield CounterMetricFamily("wamrt_generation_jobs", "World-generation jobs finished (any outcome)",
                                  value=s["jobs"])
        yield CounterMetricFamily("wamrt_generation_segments", "Device segments world generation ran",
                                  value=s["segments"])
        yield CounterMetricFamily("wamrt_generation_device_seconds", "Device time world generation held",
                                  value=s["device_seconds"])
        yield GaugeMetricFamily("wamrt_generation_segment_max_seconds",
                                "Longest device segment of world generation so far", value=s["segment_max_seconds"])
        yield GaugeMetricFamily("wamrt_generation_running", "World-generation jobs running", value=s["running"])
        yield GaugeMetricFamily("wamrt_generation_queued", "World-generation jobs queued", value=s["queued"])
