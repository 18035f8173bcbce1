"""What a server needs of the policy engine beyond one batch (a part of `Engine`, like `GraphCapture`): per-thread
state, so that a background capture (`graph_ladder`) and the request path run the loop at once, each with its own
step kinds and layer path (the request path uncompiled while a new shape compiles elsewhere); the frame-0 encode
warmed at every batch size before requests arrive; and an out-of-memory that never sinks a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from ..ops.capture_turn import empty_cache
from ..pipeline.denoise import SamplingOptions
from ..pipeline.droid import PreparedDroid, encode_canvases
from .layer_path import LayerPath, build_layer_path

log = logging.getLogger(__name__)


class Served:
    """Mixed into `Engine`: it uses the engine's `_local` (threading.local), `config`, `model`, `device`,
    `_eager_path`, the compiled pieces (`_embed`, `_pre`, `_post`, `_finish`, `_rescale`), `_host_inputs`,
    `_encode_stream`, `_canvas_encoder`, `_denoise` and `out_of_memory`."""

    _eager_path: LayerPath | None

    # Per-thread state: a background capture (graph_ladder) and the request path run the loop at once --------------
    @property
    def _kinds_needed(self) -> set[bool] | None:
        """The step kinds (guided or not) the loop being built runs (`_step_batches` skips the others)."""
        return getattr(self._local, "kinds_needed", None)

    @_kinds_needed.setter
    def _kinds_needed(self, value: set[bool] | None) -> None:
        self._local.kinds_needed = value

    @contextmanager
    def uncompiled(self) -> Iterator[None]:
        """Run this thread's Generator passes uncompiled: a request served while its bucket is captured elsewhere
        would otherwise compile its new shape on the request path (the same function, other roundings)."""
        if self._eager_path is None and self.config.compile:
            self._eager_path = build_layer_path(self.model, replace(self.config, compile=False), self.device)
        saved = getattr(self._local, "eager", False)
        self._local.eager = self.config.compile
        try:
            yield
        finally:
            self._local.eager = saved

    def _layer_pieces(self) -> tuple:
        """(embed, pre, post, finish) this thread runs."""
        if getattr(self._local, "eager", False):
            p = self._eager_path
            assert p is not None
            return p.embed, p.pre, p.post, p.finish
        return self._embed, self._pre, self._post, self._finish

    def _rescale_here(self, *args: Any) -> torch.Tensor:
        eager = getattr(self._local, "eager", False) and self._eager_path is not None
        return (self._eager_path.rescale if eager else self._rescale)(*args)  # type: ignore[union-attr]

    def warm_up_encoder(self, observation: Mapping[str, Any], batch_sizes: Collection[int]) -> None:
        """Run the frame-0 encode at every batch size a server forms (on CUDA: capture its graph for each), so that
        no request waits for one. A bad observation raises its RequestError."""
        with torch.inference_mode():
            for b in sorted(set(batch_sizes)):
                hosts = self._host_inputs([observation] * b)
                bad = next((h for h in hosts if isinstance(h, Exception)), None)
                if bad is not None:
                    raise bad
                stream = self._encode_stream()
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    encode_canvases(self._canvas_encoder, [h.padded for h in hosts], self.device,  # type: ignore[union-attr]
                                    self.config.vae_frames, pad_on_device=self.config.canvas_on_device)
                if stream is not None:
                    stream.synchronize()

    def _denoise_guarded(self, preps: list[PreparedDroid], opts: SamplingOptions):
        """`_denoise`, an out-of-memory never the batch's end: the cached blocks released, the batch runs again one
        request at a time (each on its own graph, or uncaptured), and a request that still does not fit gets the
        error in its slot (a server answers it with a typed 503) while the others get their actions."""
        try:
            return self._denoise(preps, opts)
        except torch.OutOfMemoryError as exc:
            self._release_memory()
            log.warning("out of device memory in a batch of %d (%s): running its requests one at a time", len(preps),
                        str(exc).splitlines()[0][:200])
            if len(preps) == 1:
                self.out_of_memory["refused"] += 1
                return [exc], {}
        self.out_of_memory["retried"] += len(preps)
        finals: list = []
        timings: dict[str, float] = {}
        for prep in preps:
            try:
                one, timings = self._denoise([prep], opts)
                finals += one
            except torch.OutOfMemoryError as exc:
                self._release_memory()
                self.out_of_memory["refused"] += 1
                finals.append(exc)
        return finals, timings

    def _release_memory(self) -> None:
        """Hand the caching allocator's unused blocks back (graph pools and live tensors stay)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            empty_cache()  # not while the background ladder captures
