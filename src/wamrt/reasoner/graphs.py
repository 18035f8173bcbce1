"""CUDA graphs of the decode step: one per (rows, span) bucket, replayed with the step's tokens, cache positions
and MRoPE positions copied into its static inputs. A decode step at batch 1 is ~4 ms of weight reads on an H200 at
Nano size and launches ~20 kernels per layer; replaying them as one graph takes the launch overhead off.

Capturing writes the step's K/V: warm-up and capture write at the cache's last position, which `DecodeBatch`
never hands to a sequence, so capturing in the middle of live sequences leaves their cache intact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..ops.capture_turn import capture_turn, capture_turn_if_free, graph_capture
from .lm import KVCache, LayerFn, ReasonerLM

log = logging.getLogger("wamrt.reasoner")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B] long
    index: torch.Tensor  # [B] long
    rope_pos: torch.Tensor  # [B] long (text positions are whole: `ReasonerLM.text_rope`)
    logits: torch.Tensor  # [B, V] float32


class DecodeGraphs:
    def __init__(self, lm: ReasonerLM, cache: KVCache, layer_fn: LayerFn | None = None, attention: str = "sdpa"
                 ) -> None:
        if lm.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.lm, self.cache, self.layer_fn, self.attention = lm, cache, layer_fn, attention
        self.entries: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @property
    def scratch(self) -> int:
        """The cache position captures write to (never a sequence's)."""
        return self.cache.length - 1

    def step(self, tokens: torch.Tensor, index: torch.Tensor, rope_pos: torch.Tensor, span: int) -> torch.Tensor:
        """tokens, index, rope_pos [B]: on the device, or in pinned host memory (copied straight into the graph's
        inputs, one copy each and none in between)."""
        key = (tokens.shape[0], span)
        entry = self.entries.get(key)
        if entry is None:
            with capture_turn_if_free() as free:
                if not free:
                    # Another thread is capturing (the policy ladder: a Nano graph's compile holds the turn ~20 s),
                    # and this thread holds the device for its step: run it on the eager layers (no compile beside a
                    # capture) and capture at a later step rather than keep policy requests waiting meanwhile.
                    dev = self.lm.device
                    return self.lm.decode_step(self.cache, tokens.to(dev), index.to(dev), rope_pos.to(dev), span, None,
                                               self.attention)
                entry = self.capture(*key)
        entry.tokens.copy_(tokens, non_blocking=True)
        entry.index.copy_(index, non_blocking=True)
        entry.rope_pos.copy_(rope_pos, non_blocking=True)
        entry.graph.replay()
        return entry.logits

    @torch.no_grad()
    def capture(self, rows: int, span: int) -> _Graph:
        dev = self.lm.device
        tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        index = torch.full((rows,), self.scratch, dtype=torch.long, device=dev)
        rope_pos = torch.zeros(rows, dtype=torch.long, device=dev)
        with capture_turn():  # the warm-up compiles, and no other thread may capture meanwhile (ops.capture_turn)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, lazy inits, compiling)
                for _ in range(2):
                    try:
                        self.lm.decode_step(self.cache, tokens, index, rope_pos, span, self.layer_fn,
                                            self.attention)
                    except Exception as exc:  # a compiler failure costs speed, not the chat: the eager layers remain
                        if self.layer_fn is None:
                            raise
                        log.warning("fused decode layers failed to compile (%s); decoding with the eager layers",
                                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                        self.layer_fn = None
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=self.pool):
                logits = self.lm.decode_step(self.cache, tokens, index, rope_pos, span, self.layer_fn,
                                             self.attention)
        entry = _Graph(graph, tokens, index, rope_pos, logits)
        self.entries[(rows, span)] = entry
        return entry
