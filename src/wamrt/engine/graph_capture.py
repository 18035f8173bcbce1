"""Capture and replay of the policy engine's denoising loop: one CUDA graph per shape bucket, kept in the
`GraphCache`, replayed with the request's latents, Reasoner K/V and RoPE copied into the graph's static inputs.

A batch whose bucket has no graph replays a compatible one (more rows, a wider prefix), or, when captures stay off
the request path (`EngineConfig.capture_on_request=False`), runs as replays of smaller captured buckets, or
uncaptured and uncompiled, while a background thread captures the bucket it wanted (`graph_ladder.CaptureWorker`):
no request waits for a capture (7-35 s at Nano: compile, warm-up runs, record).

`GraphCapture` is a part of `Engine`, apart so that the engine reads in one sitting. It uses the engine's
`graphs` (GraphCache), `kv_arena`, `config`, `contract`, `device`, its eager loop `_loop` and the batch helpers
`_loop_batches`, `_pad_prefixes` and `_bucket_lengths`. `_warm` and `_record` are the only CUDA-specific steps: CPU
tests stand in for them by subclassing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..model import Rope
from ..ops.capture_turn import capture_turn, graph_capture
from .graph_cache import CapturedGraph, CaptureTimer, GraphKey, graph_pool_bytes, ladder_rung, tensor_bytes
from .kv_buffers import BatchBranch
from .prefix_cache import StackedKV, copy_lists

log = logging.getLogger(__name__)


@dataclass
class LoopInputs:
    """One batch's denoising-loop inputs, its prefixes exact (unpadded): what a capture off the request path
    starts from (grown to the bucket's rows and padded to its width there)."""

    x_v: torch.Tensor
    x_a: torch.Tensor
    static: dict[str, torch.Tensor]
    conds: list[BatchBranch]
    unconds: list[BatchBranch]
    plan: object
    timesteps: list[float]
    cfg_steps: list[bool]
    opts: object
    raw_dim: int

    def rows(self, start: int, stop: int) -> LoopInputs:
        """Requests [start, stop) of the batch, renumbered from 0."""

        def pick(seqs: list[BatchBranch]) -> list[BatchBranch]:
            return [BatchBranch(s.request - start, s.kv, s.rope) for s in seqs if start <= s.request < stop]

        static = {k: v[start:stop] for k, v in self.static.items()}
        return LoopInputs(self.x_v[start:stop], self.x_a[start:stop], static, pick(self.conds), pick(self.unconds),
                          self.plan, self.timesteps, self.cfg_steps, self.opts, self.raw_dim)


class GraphCapture:
    # Serve a bucket the cache lacks from a larger captured one (GraphKey.serves); CFG-parallel ranks must
    # decide in lockstep, so they keep exact buckets (and capture on the request path).
    reuse_compatible_graphs = True
    _in_warmup = False  # inside capturing_exact_buckets: captures count as warm-up's

    @contextmanager
    def capturing_exact_buckets(self) -> Iterator[None]:
        """Warm-up: capture every bucket met, not a compatible larger one (a batch of 1 replaying the batch-8
        graph would cost 8 requests' compute on every call)."""
        saved = self.reuse_compatible_graphs
        self.reuse_compatible_graphs, self._in_warmup = False, True
        try:
            yield
        finally:
            self.reuse_compatible_graphs, self._in_warmup = saved, False

    def _graph_key(self, x_v, x_a, conds, unconds, timesteps, cfg_steps, opts, raw_dim) -> GraphKey:
        # Masks, domain ids and prefix anchors are static inputs refreshed on every replay (their shapes are the
        # contract's), so neither their values nor a request's prefix length are part of the key.
        return GraphKey(x_v.shape[0], tuple(x_v.shape[1:]), tuple(x_a.shape[1:]), self._bucket_lengths(conds, unconds),
                        (tuple(timesteps), tuple(cfg_steps), opts.guidance, opts.solver, raw_dim, self.contract),
                        bucketed=bool(self.config.prompt_bucket))

    def _captures_on_request(self) -> bool:
        """A missing bucket is captured on the request path: asked for, in warm-up (exact buckets), by CFG-parallel
        ranks (lockstep), and for isolated requests (their bits must not depend on what was captured yet)."""
        return self.config.capture_on_request or not self.reuse_compatible_graphs or self.config.isolate_requests

    def _graph_loop(self, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim, *,
                    exact=None):
        n = x_v.shape[0]
        key = self._graph_key(x_v, x_a, conds, unconds, timesteps, cfg_steps, opts, raw_dim)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.count("exact", n)
            return self._replay_entry(entry, x_v, x_a, static, conds, unconds)
        # An isolated request never runs on a wider or larger graph: its bits would depend on what was captured.
        reuse = self.reuse_compatible_graphs and exact is not None and not self.config.isolate_requests
        if reuse:
            larger = self.graphs.compatible_entry(key)
            if larger is not None:
                self.graphs.count("wider", n)
                return self._replay_fitted(*larger, x_v, x_a, static, *exact)
        if self._captures_on_request():
            cause = "warmup" if self._in_warmup else "request"
            entry = self._capture_timed(key, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts,
                                        raw_dim, cause=cause)
            if cause == "request":
                self.graphs.count("waited", n)
            return self._replay_entry(entry, x_v, x_a, static, conds, unconds)
        # Off the request path: the bucket this batch wanted is captured in the background; meanwhile it runs on
        # smaller captured buckets, or uncaptured.
        if exact is not None:
            self.want_bucket(self._ladder_key(key), LoopInputs(x_v, x_a, static, *exact, plan, timesteps, cfg_steps,
                                                                opts, raw_dim))
        chunks = self.graphs.split_entries(key) if reuse else None
        if chunks is not None:
            self.graphs.count("split", n)
            inputs = LoopInputs(x_v, x_a, static, *exact, plan, timesteps, cfg_steps, opts, raw_dim)  # type: ignore[misc]
            outs, start = [], 0
            for rows, bucket, entry in chunks:
                part = inputs.rows(start, start + rows)
                outs.append(self._replay_fitted(bucket, entry, part.x_v, part.x_a, part.static, part.conds,
                                                part.unconds))
                start += rows
            return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        self.graphs.count("eager", n)
        return self._loop_uncaptured(LoopInputs(x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts,
                                                raw_dim))

    def _ladder_key(self, key: GraphKey) -> GraphKey:
        """The bucket to capture for a batch of `key`: its size rounded up to the batch ladder (prompt buckets)."""
        rung = ladder_rung(key.batch, self.config.batch_ladder)
        return key.rows(rung) if key.bucketed and rung is not None else key

    def _loop_uncaptured(self, inputs: LoopInputs):
        """The loop without a graph, one request at a time (the memory of one), uncompiled: a new shape would
        otherwise compile on the request path."""
        outs = []
        with self.uncompiled():
            for r in range(inputs.x_v.shape[0]):
                p = inputs.rows(r, r + 1)
                outs.append(self._loop(p.x_v, p.x_a, p.static, p.conds, p.unconds, p.plan, p.timesteps, p.cfg_steps,
                                       p.opts, p.raw_dim))
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def _replay_fitted(self, key: GraphKey, entry: CapturedGraph, x_v, x_a, static: dict, conds: list[BatchBranch],
                       unconds: list[BatchBranch]):
        """Replay `entry` (held: even if evicted meanwhile) with the batch grown and padded to its bucket `key`."""
        n = x_v.shape[0]
        x_v, x_a, static, conds, unconds = self._fit_rows(key, x_v, x_a, static, conds, unconds)
        out = self._replay_entry(entry, x_v, x_a, static, conds, unconds)
        return out[0][:n], out[1][:n]

    def _replay_entry(self, entry: CapturedGraph, x_v, x_a, static, conds, unconds):
        n = x_v.shape[0]
        ins = entry.inputs
        ins["x_v"].copy_(x_v)
        ins["x_a"].copy_(x_a)
        torch._foreach_copy_(list(ins["static"].values()), [static[k] for k in ins["static"]])
        for dst, src in zip(ins["seqs"], conds + unconds, strict=True):
            out, into = copy_lists(dst.kv, src.kv)
            torch._foreach_copy_(out + [dst.rope.cos, dst.rope.sin], into + [src.rope.cos, src.rope.sin])
        entry.graph.replay()
        assert entry.outputs is not None
        return entry.outputs[0][:n].clone(), entry.outputs[1][:n].clone()

    def _fit_rows(self, key: GraphKey, x_v, x_a, static: dict, conds: list[BatchBranch], unconds: list[BatchBranch]):
        """A batch grown to `key`'s rows (copies of its last request; their results are dropped) with its exact
        prefixes padded to `key`'s width: what a replay copies in (latents, masks, anchors, K/V, rope)."""
        n, m = x_v.shape[0], key.batch

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t[-1:].expand(m - n, *t.shape[1:])]) if m > n else t

        def grow_seqs(seqs: list[BatchBranch]) -> list[BatchBranch]:
            return seqs + [BatchBranch(r, seqs[-1].kv, seqs[-1].rope) for r in range(n, m)] if seqs else seqs

        conds, unconds = self._pad_prefixes(grow_seqs(conds), grow_seqs(unconds), width=key.width)
        return grow(x_v), grow(x_a), {k: grow(v) for k, v in static.items()}, conds, unconds

    # --- capture --------------------------------------------------------------------------------------------
    def _graph_pool_handle(self):
        """The memory pool every captured graph of this engine shares (made on first use)."""
        with self._capture_lock:
            if self._graph_pool is None:  # on the CPU (tests' stand-in captures) a token: no allocator pool to read
                self._graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else ("cpu", id(self))
            return self._graph_pool

    def _capture_timed(self, key: GraphKey, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts,
                       raw_dim, *, cause: str) -> CapturedGraph:
        """Capture `key`'s graph from these (padded) inputs and add it to the cache, timed and its memory counted.
        One capture at a time (the request path in warm-up, or the background thread), and in the process: the
        warm-up runs and the recording hold the capture turn (`ops.capture_turn`)."""
        with capture_turn(), self._capture_lock:
            pool = self._graph_pool_handle()
            with CaptureTimer(self.device, pool) as timer:
                entry = self._capture(x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim)
            entry.seconds, entry.pool, entry.cause = timer.seconds, pool, cause
            entry.nbytes = tensor_bytes(entry.inputs, entry.outputs)
            self.graphs.add(key, entry)
        log.info("captured a CUDA graph for batch %d, prefix width %s (%s) in %.1f s: graph pool +%.2f GiB to %.2f "
                 "GiB, static inputs %.2f GiB", key.batch, key.width if key.bucketed else list(key.lengths), cause,
                 timer.seconds, timer.pool_growth / 2**30, graph_pool_bytes(self.device, pool) / 2**30,
                 entry.nbytes / 2**30)
        return entry

    def _capture(self, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim) -> CapturedGraph:
        log.info("capturing a CUDA graph for bucket vision %s, prefixes %s", tuple(x_v.shape),
                 [s.kv.length for s in conds + unconds])
        entry = CapturedGraph()
        seqs = [clone_branch(s) for s in conds + unconds]
        s_conds, s_unconds = seqs[: len(conds)], seqs[len(conds):]
        ins = {"x_v": x_v.clone(), "x_a": x_a.clone(), "seqs": seqs,
               "static": {k: v.clone() for k, v in static.items()}}
        entry.inputs = ins

        def run():
            return self._loop(ins["x_v"], ins["x_a"], ins["static"], s_conds, s_unconds, plan, timesteps, cfg_steps,
                              opts, raw_dim)

        # Warm-up runs (compile, autotune, cuDNN plans) on fresh K/V buffers: a background capture's runs then never
        # write the arena that graphs replaying on the request path read. The capture itself takes its buffers from
        # the arena every graph shares (allocated outside capture, sized for the largest bucket of the ladder: a
        # larger one replaces it, and graphs captured on the old one keep that alive) and its temporaries from the
        # pool every graph shares. Sharing is safe because replays are sequential on one stream, each replay writes
        # every buffer it reads (prefixes and Generator K/V included) before reading it, and its outputs are cloned
        # before any other graph replays. (Made inside each capture, the buffers stayed allocated per graph: a server
        # warming batch sizes 1..8 of Nano ran out of 141 GB at batch 6-7.)
        self._warm(run)
        kinds = self._loop_batches(conds, unconds, cfg_steps)
        arena = self.kv_arena.reserve(kinds, at_least=self._arena_plan(kinds))
        with self.kv_arena.allocating():
            entry.outputs = self._record(entry, run)
        # The graph reads tensors made before capture (the sampler plan's divisors, the K/V arena): they
        # must live as long as the graph, or replays read freed memory.
        entry.keepalive = (plan, run, arena)
        return entry

    def _arena_plan(self, kinds: list[list[BatchBranch]]) -> int:
        """Arena elements for the largest bucket the ladder will capture (so the arena is allocated once): these
        batches' buffers scaled to the ladder's largest batch and widest prefix; 0 without a ladder."""
        if not self.config.batch_ladder or not kinds or not kinds[0]:
            return 0
        requests = 1 + max(s.request for seqs in kinds for s in seqs)
        scale = max(1, max(self.config.batch_ladder) // requests)
        widest = max(self._width_rungs(), default=0)

        def stretch(seqs: list[BatchBranch]) -> list[BatchBranch]:
            width = max(widest, max(s.kv.length for s in seqs))
            return [BatchBranch(s.request, _Length(seqs[0].kv, width), s.rope) for s in seqs] * scale

        return self.kv_arena.elements([stretch(seqs) for seqs in kinds])

    def _warm(self, run) -> None:
        """Run the loop on a side stream (compile, autotune, cuDNN plan selection happen here, not in capture): twice
        before the engine's first capture (the process's lazy initialisations), once before later ones (a new shape
        compiles and picks its kernels on its first run; a second is ~5 s of GPU time at Nano batch 8).
        (CUDA-specific: nothing to warm on the CPU, where tests stand in for the capture.)"""
        if self.device.type != "cuda":
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2 if self.graphs.captures == 0 else 1):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _record(self, entry: CapturedGraph, run) -> tuple[torch.Tensor, torch.Tensor]:
        """Capture `run` into `entry.graph` in the pool every graph shares. Thread-local capture mode: another
        thread (the request path, while a background capture runs) may launch work and allocate meanwhile.
        (The only CUDA-specific step of capture besides `_warm`: tests stand in for it on the CPU.)"""
        entry.graph = torch.cuda.CUDAGraph()
        with graph_capture(entry.graph, pool=self._graph_pool_handle()):
            return run()


class _Length:
    """A stand-in ReasonerKV of `length` tokens with `like`'s layers, heads and masking: what
    `KVBufferArena.elements` reads."""

    def __init__(self, like, length: int) -> None:
        self.keys, self.key_mask, self.length = like.keys, like.key_mask, length


def clone_branch(s: BatchBranch) -> BatchBranch:
    """A sequence's own copy, its K/V in one storage: the static input buffers a captured graph reads."""
    return BatchBranch(s.request, StackedKV.of(s.kv).clone(), Rope(s.rope.cos.clone(), s.rope.sin.clone()))

