"""Rank 0's world generation over every rank of a `WorldLayout` (`WorldFront`), and the workers' side of it.

The request path (validation, prompts, conditioning encode, noise, decode) runs on rank 0 only; only its denoising
loop runs on every rank. `WorldFront.run` is `run_world` with a denoiser that first sends the loop's inputs (moved
to the host: the request's token ids, positions, noise and conditioning latents, tens of MB at 720p) to every
worker over its pipe and then runs rank 0's `ParallelWorldEngine` loop; each worker runs the same loop
(`follow_world_request`), meeting rank 0 in the collectives. The full latents come back on rank 0 (they are
gathered on every rank), and rank 0 decodes them.

After every step all ranks take one decision together (one broadcast of a flag from rank 0): whether rank 0's
`on_step` (progress, cancellation, yielding the device to policy requests) raised. If it did, every rank leaves
the loop there, so a cancelled job does not leave the workers waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..pipeline.world import WorldResult, run_world

log = logging.getLogger("wamrt.parallel")


class StepsStopped(Exception):
    """Rank 0 left the denoising loop after this step (its `on_step` raised)."""


def moved(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor inside (dataclasses, tuples, lists, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)):
        return type(obj)(moved(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: moved(v, device) for k, v in obj.items()}
    return obj


def _agree(stop: bool, device: torch.device) -> bool:
    """Every rank calls this after each step; rank 0's `stop` is the answer on all of them."""
    flag = torch.full((1,), int(stop), dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class WorldFront:
    """`run` / `run_distilled` / `decode_pixels` as `WorldEngine`'s (what `serving.world_model.WorldModel` and
    `wamrt bench parallel --world` call), on rank 0 of a running parallel group whose workers follow
    (`follow_world_request`)."""

    def __init__(self, engine: Any, conns: list, check_workers: Callable[[], None]) -> None:
        self.engine, self._conns, self._check_workers = engine, conns, check_workers
        self.model, self.encoder, self.tokenizer = engine.model, engine.encoder, engine.tokenizer
        self.name = engine.name
        self.step_segments = engine.step_segments

    def run(self, *, on_segment: Callable[[], None] | None = None, **kwargs: Any) -> WorldResult:
        """`run_world(model, encoder, tokenizer, **kwargs)` with the denoising loop on every rank."""
        return run_world(self.model, self.encoder, self.tokenizer, denoiser=self._denoiser("denoise", on_segment),
                         decoder=self.engine.decode_pixels, **kwargs)

    def run_distilled(self, *, on_segment: Callable[[], None] | None = None, **kwargs: Any) -> WorldResult:
        """`run_world_distilled(...)` with the denoising loop on every rank."""
        from ..pipeline.world_distilled import run_world_distilled

        return run_world_distilled(self.model, self.encoder, self.tokenizer,
                                   denoiser=self._denoiser("denoise_distilled", on_segment),
                                   decoder=self.engine.decode_pixels, **kwargs)

    def decode_pixels(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.engine.decode_pixels(*args, **kwargs)

    def metadata(self) -> dict[str, Any]:
        return self.engine.metadata()

    def _denoiser(self, method: str, on_segment: Callable[[], None] | None) -> Callable[..., Any]:
        device = self.engine.device

        def denoise(model: Any, inputs: Any, *args: Any, on_step: Callable[[int, int], None] | None = None,
                    **kwargs: Any) -> Any:
            self._check_workers()
            msg = ("world", method, moved((inputs, *args), "cpu"), kwargs)
            for c in self._conns:
                c.send(msg)

            def lead(i: int, n: int) -> None:
                failure = None
                if on_step is not None:
                    try:
                        on_step(i, n)
                    except BaseException as e:  # noqa: BLE001  # re-raised below, after the workers know
                        failure = e
                if _agree(failure is not None, device) and failure is not None:
                    raise failure

            return getattr(self.engine, method)(model, inputs, *args, on_step=lead, on_segment=on_segment, **kwargs)

        return denoise


def follow_world_request(engine: Any, msg: tuple, device: torch.device) -> None:
    """A worker's part of one world request (`msg` from `WorldFront`): the same denoising loop as rank 0's."""
    _, method, (inputs, *rest), kwargs = msg
    # The loop's inputs and tensor arguments (the distilled sampler's noise) were on rank 0's device; a sampler plan
    # keeps its host tensors where they are.
    inputs = moved(inputs, device)
    rest = [a.to(device) if isinstance(a, torch.Tensor) else a for a in rest]

    def follow(i: int, n: int) -> None:
        if _agree(False, device):
            raise StepsStopped

    try:
        getattr(engine, method)(engine.model, inputs, *rest, on_step=follow, **kwargs)
    except StepsStopped:
        log.debug("world request stopped by rank 0")


__all__ = ["StepsStopped", "WorldFront", "follow_world_request", "moved"]
