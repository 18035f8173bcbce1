"""Capture and replay of the policy engine's denoising loop: one CUDA graph per shape bucket, kept in the
`GraphCache`, replayed with the request's latents, Reasoner K/V and RoPE copied into the graph's static inputs.

`GraphCapture` is a part of `Engine`, apart so that the engine reads in one sitting. It uses the engine's
`graphs` (GraphCache), `kv_arena`, `config`, `contract`, `device`, `_graph_pool`, its eager loop `_loop` and the
batch helpers `_loop_batches`, `_pad_prefixes` and `_bucket_lengths`. `_record` is the only CUDA-specific step:
CPU tests stand in for it by subclassing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..model import Rope
from .graph_cache import CapturedGraph, CaptureTimer, GraphKey
from .kv_buffers import BatchBranch
from .prefix_cache import StackedKV, copy_lists

log = logging.getLogger(__name__)


class GraphCapture:
    # Serve a bucket the cache lacks from a larger captured one (GraphKey.serves); CFG-parallel ranks must
    # decide in lockstep, so they keep exact buckets.
    reuse_compatible_graphs = True

    @contextmanager
    def capturing_exact_buckets(self) -> Iterator[None]:
        """Warm-up: capture every bucket met, not a compatible larger one (a batch of 1 replaying the batch-8
        graph would cost 8 requests' compute on every call)."""
        saved = self.reuse_compatible_graphs
        self.reuse_compatible_graphs = False
        try:
            yield
        finally:
            self.reuse_compatible_graphs = saved

    def _graph_key(self, x_v, x_a, conds, unconds, timesteps, cfg_steps, opts, raw_dim) -> GraphKey:
        # Masks, domain ids and prefix anchors are static inputs refreshed on every replay (their shapes are the
        # contract's), so neither their values nor a request's prefix length are part of the key.
        return GraphKey(x_v.shape[0], tuple(x_v.shape[1:]), tuple(x_a.shape[1:]), self._bucket_lengths(conds, unconds),
                        (tuple(timesteps), tuple(cfg_steps), opts.guidance, opts.solver, raw_dim, self.contract),
                        bucketed=bool(self.config.prompt_bucket))

    def _graph_loop(self, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim, *,
                    exact=None):
        n = x_v.shape[0]
        key = self._graph_key(x_v, x_a, conds, unconds, timesteps, cfg_steps, opts, raw_dim)
        entry = self.graphs.get(key)
        # An isolated request never runs on a wider or larger graph: its bits would depend on what was captured.
        if entry is None and self.reuse_compatible_graphs and exact is not None and not self.config.isolate_requests:
            larger = self.graphs.compatible(key)
            if larger is not None:
                x_v, x_a, static, conds, unconds = self._fit_rows(larger, x_v, x_a, static, *exact)
                key, entry = larger, self.graphs.get(larger)
        if entry is None:
            with CaptureTimer(self.device) as timer:
                entry = self._capture(x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim)
            entry.seconds, entry.nbytes = timer.seconds, timer.nbytes
            self.graphs.add(key, entry)
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

        # Memory shared by every bucket's graph: the K/V buffers (28 GiB at Nano batch 8) come from one
        # arena allocated outside capture, and the temporaries from one graph pool. Made inside each
        # capture, the buffers stayed allocated per graph: a server warming batch sizes 1..8 of Nano ran
        # out of 141 GB at batch 6-7. Sharing is safe because replays are sequential on one stream, each
        # replay writes every buffer it reads (prefixes and Generator K/V included) before reading it,
        # and its outputs are cloned before any other graph replays. A bigger bucket gets a bigger arena;
        # graphs captured on the old one keep it alive, so warm the largest batch first.
        arena = self.kv_arena.reserve(self._loop_batches(conds, unconds, cfg_steps))
        with self.kv_arena.allocating():
            entry.outputs = self._record(entry, run)
        # The graph reads tensors made before capture (the sampler plan's divisors, the K/V arena): they
        # must live as long as the graph, or replays read freed memory.
        entry.keepalive = (plan, run, arena)
        return entry

    def _record(self, entry: CapturedGraph, run) -> tuple[torch.Tensor, torch.Tensor]:
        """Warm `run` up on a side stream, then capture it into `entry.graph` in the pool every graph shares.
        (The only CUDA-specific step of capture: tests stand in for it on the CPU.)"""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile / autotune / cuDNN plan selection happen here, not in capture
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self._graph_pool):
            return run()


def clone_branch(s: BatchBranch) -> BatchBranch:
    """A sequence's own copy, its K/V in one storage: the static input buffers a captured graph reads."""
    return BatchBranch(s.request, StackedKV.of(s.kv).clone(), Rope(s.rope.cos.clone(), s.rope.sin.clone()))
