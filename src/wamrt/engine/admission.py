"""Request admission of the policy engine (a part of `Engine`, like `Served`): each request's seed (the framework
server's sequence, the next seed's noise drawn ahead), validation and canvases on host threads, the frame-0 VAE
encode of the batch on a side stream, and every valid request's tokens and noise (`finish_droid`). A bad request
gets its error in its slot; the others go on to the denoising loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..pipeline.denoise import DenoiseInputs
from ..pipeline.droid import DroidHostInputs, PreparedDroid, droid_host_inputs, encode_canvases, finish_droid
from ..pipeline.errors import RequestError
from ..pipeline.noise import GaussianPrefetcher
from .stage_clock import StageClock

HOST_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))  # canvas threads of a batch (the rest: server, GPU)


@dataclass
class Admitted:
    """A batch after admission. `results`: the refused requests' errors in their slots (None elsewhere);
    `prepared`: (slot, request) of the others, longest prefixes first (a graph's key then depends on which requests
    share the batch, not on the order they arrived in); `clock` timed the VAE encodes, one per `group_of[slot]`."""

    results: list[Any]
    prepared: list[tuple[int, PreparedDroid]] = field(default_factory=list)
    clock: StageClock | None = None
    group_of: dict[int, int] = field(default_factory=dict)
    _encode_ms: dict[str, float] = field(default_factory=dict)

    def encode_ms(self, slot: int) -> float:
        """The VAE encode time charged to a request; read once the device is synchronized (after a denoise)."""
        if not self._encode_ms and self.clock is not None:
            self._encode_ms = self.clock.ms()
        return self._encode_ms[f"vae_encode{self.group_of[slot]}"]


class RequestAdmission:
    """Mixed into `Engine`: it uses the engine's `config`, `model`, `encoder`, `tokenizer`, `contract`, `device`,
    `_canvas_encoder` and `_sync`."""

    def _init_admission(self) -> None:
        self._seeds = np.random.default_rng(0)
        self._upcoming_seed = int(self._seeds.integers(0, 2**31))
        self._noise = GaussianPrefetcher()
        self._noise_shape: tuple[int, ...] | None = None
        self._host_pool: ThreadPoolExecutor | None = None  # batch preprocessing (see _host_inputs)
        self._vae_stream: torch.cuda.Stream | None = None  # the VAE encode's side stream (see _admit)

    def next_seed(self) -> int:
        """The framework server's seed sequence. The seed after it is known now; its noise is drawn on
        a background thread while this request's denoising loop occupies the GPU (see _denoise)."""
        seed, self._upcoming_seed = self._upcoming_seed, int(self._seeds.integers(0, 2**31))
        return seed

    def _prefetch_noise(self) -> None:
        # Called once the GPU has the whole loop queued: the numpy draw holds the GIL, so run earlier
        # it would stall this request's own host-side preprocessing.
        if self._noise_shape is not None:
            self._noise.prefetch(self._upcoming_seed, self._noise_shape)

    def _admit(self, observations: list[Mapping[str, Any]], seeds: list[int | None] | None) -> Admitted:
        """Seeds, validation, the VAE encode and the tokens of a batch (inside `torch.inference_mode`)."""
        # Seeds in request order, a failing request's included: the sequence stays the framework server's.
        resolved = [self.next_seed() if s is None else s for s in (seeds or [None] * len(observations))]
        hosts = self._host_inputs(observations)
        out = Admitted([h if isinstance(h, Exception) else None for h in hosts], clock=StageClock(self.device))
        ok = [i for i, h in enumerate(hosts) if not isinstance(h, Exception)]
        # One VAE call for the batch (each request is charged the call), or one per request when isolated. On
        # CUDA it runs on a side stream and nothing waits for it on the host: the requests' host work below
        # (tokens, noise, positions; stage_clock.py) runs while the GPU encodes.
        encode_stream = self._encode_stream()
        for g, group in enumerate([[i] for i in ok] if self.config.isolate_requests else [ok] if ok else []):
            out.clock.start(f"vae_encode{g}", encode_stream)
            with torch.cuda.stream(encode_stream) if encode_stream is not None else nullcontext():
                latents = encode_canvases(self._canvas_encoder, [hosts[i].padded for i in group], self.device,
                                          self.config.vae_frames, pad_on_device=self.config.canvas_on_device)
            out.clock.stop(f"vae_encode{g}", encode_stream)
            if not self.config.overlap_encode:
                self._sync()
            for i, latent0 in zip(group, latents, strict=True):
                try:
                    prep = finish_droid(hosts[i], latent0, model=self.model, encoder=self.encoder,
                                        tokenizer=self.tokenizer, contract=self.contract, seed=resolved[i],
                                        device=self.device, noise=self._noise,
                                        latent_ready=self._after_encode(encode_stream, latent0),
                                        max_prompt_tokens=self.config.max_prompt_tokens, guided_prefix=False)
                except RequestError as e:  # an instruction over the limit, a guided prefix: its slot only
                    out.results[i] = e
                    continue
                out.group_of[i] = g  # its time is known once the device is synchronized (after the denoise)
                out.prepared.append((i, prep))
                self._noise_shape = tuple(prep.inputs.vision.shape)
        out.prepared.sort(key=lambda ip: _prefix_lengths(ip[1].inputs), reverse=True)
        return out

    def _host_inputs(self, observations: list[Mapping[str, Any]]) -> list[DroidHostInputs | RequestError]:
        """Validation and canvases of a batch, in threads when it has several requests: the resizes are torch
        CPU ops that release the GIL, and one at a time they bounded a 16-lane server at ~35 requests/s. An item
        that already is a `DroidHostInputs` (made by the caller with `droid_host_inputs` and this engine's
        `contract`, e.g. in the strategy x delay grid's simulator processes) is taken as it is."""

        def one(obs: Mapping[str, Any] | DroidHostInputs) -> DroidHostInputs | RequestError:
            if isinstance(obs, DroidHostInputs):
                return obs
            try:
                return droid_host_inputs(obs, self.contract)
            except RequestError as e:
                return e

        if len(observations) == 1:
            return [one(observations[0])]
        if self._host_pool is None:
            self._host_pool = ThreadPoolExecutor(max_workers=HOST_THREADS, thread_name_prefix="wamrt-prep")
        return list(self._host_pool.map(one, observations))

    def _encode_stream(self) -> torch.cuda.Stream | None:
        """The side stream the VAE encode runs on (CUDA), made to start after the current stream's queued work."""
        if self.device.type != "cuda" or not self.config.overlap_encode:
            return None
        if self._vae_stream is None:
            self._vae_stream = torch.cuda.Stream(self.device)
        self._vae_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._vae_stream

    def _after_encode(self, encode_stream: torch.cuda.Stream | None, latent: torch.Tensor):
        """finish_droid's latent_ready: the current stream waits (on the GPU) for the encode; the latent, allocated on
        the encode stream, stays reserved until the current stream's queued work has read it."""
        if encode_stream is None:
            return None

        def ready() -> None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(encode_stream)
            latent.record_stream(current)

        return ready


def _prefix_lengths(inp: DenoiseInputs) -> tuple[int, int]:
    return inp.cond.input_ids.shape[1], inp.uncond.input_ids.shape[1] if inp.uncond is not None else 0
