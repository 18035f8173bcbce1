"""Long videos in chunks, as cosmos-framework (and vLLM-Omni) generate transfer videos past one chunk.

A clip of `total` frames is generated as chunks of `frames` frames (4k + 1; 93 in the peers' recipe). Chunk 0 is
the request as given (its image / video conditioning, the first frames of its controls). Each later chunk starts
`frames - conditional` frames after the previous one and conditions on the previous chunk's last `conditional`
generated frames: they become its clean leading latent frames (latent frame 0 alone for one frame, Wan2.2 encoding
the first frame of a clip on its own), the controls advance with it, and chunk k draws its noise from seed + k.
The stitched video keeps chunk 0 whole and each later chunk from its first new frame on. The last chunk is as
long as the frames left need (rounded up to 4k + 1), not a full chunk cut short.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from .errors import RequestError
from .geometry import VAE_TEMPORAL

if TYPE_CHECKING:
    from .world import WorldRequest, WorldResult


@dataclass(frozen=True)
class ChunkPlan:
    total: int  # frames of the whole clip
    frames: int  # frames per chunk, 4k + 1
    conditional: int  # frames of the previous chunk that condition the next

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(first frame, frames generated) of every chunk."""
        stride, out, start = self.frames - self.conditional, [], 0
        while True:
            left = self.total - start
            if left <= self.frames:
                out.append((start, min(self.frames, -(-(left - 1) // VAE_TEMPORAL) * VAE_TEMPORAL + 1)))
                return out
            out.append((start, self.frames))
            start += stride

    @property
    def clean_latent_frames(self) -> tuple[int, ...]:
        """A later chunk's clean latent frames: those its `conditional` leading pixel frames fall in."""
        return tuple(range((self.conditional - 1) // VAE_TEMPORAL + 1)) if self.conditional else ()


def _int(value: Any, field: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise RequestError(f"must be an integer >= {lo}, got {value!r}", field=field)
    return int(value)


def chunk_plan(total: int, frames: int | None, conditional: int = 1, *, enable_sound: bool = False
               ) -> ChunkPlan | None:
    """`num_video_frames_per_chunk` / `num_conditional_frames` -> a plan, or None when the clip fits one chunk."""
    cond = _int(conditional, "num_conditional_frames", 0)
    if frames is None:
        return None
    frames = _int(frames, "num_video_frames_per_chunk", 5)
    if (frames - 1) % VAE_TEMPORAL:
        raise RequestError(f"must be 4k + 1 (5, 9, ..., 93), got {frames}", field="num_video_frames_per_chunk")
    if cond >= frames:
        raise RequestError(f"must be below num_video_frames_per_chunk ({frames}), got {cond}",
                           field="num_conditional_frames")
    if total <= frames:
        return None
    if enable_sound:
        raise RequestError("a clip made in chunks has no sound track (each chunk's sound would be its own)",
                           field="enable_sound")
    return ChunkPlan(total, frames, cond)


RunOne = Callable[..., "WorldResult"]  # (request, generator, control_videos, chunk index) -> one chunk's result


def run_chunks(run_one: RunOne, req: WorldRequest, generator: torch.Generator | None,
               on_chunk: Callable[[int, int], None] | None = None) -> WorldResult:
    """Every chunk of `req.chunks` through `run_one`, stitched (see the module docstring)."""
    from .world import WorldResult

    plan = req.chunks
    assert plan is not None
    spans = plan.spans
    videos = None
    timings: dict[str, float] = {}
    if req.transfer is not None:  # the controls of the whole clip, once; each chunk takes its frames
        t0 = time.perf_counter()
        videos = req.transfer.videos(req.height, req.width, spans[-1][0] + spans[-1][1])
        timings["controls"] = 1e3 * (time.perf_counter() - t0)
    frames: torch.Tensor | None = None
    latents, notes, last = [], [], None
    for k, (start, length) in enumerate(spans):
        if on_chunk is not None:
            on_chunk(k, len(spans))
        sub = replace(req, num_frames=length, chunks=None)
        if k:
            sub = replace(sub, image=None, clean_latent_frames=plan.clean_latent_frames, condition_video_keep="first",
                          video=None if not plan.conditional else tuple(
                              Image.fromarray(f.numpy()) for f in frames[-plan.conditional:]))
        gen = generator
        if k and generator is not None:
            gen = torch.Generator(generator.device).manual_seed(generator.initial_seed() + k)
        last = run_one(sub, gen, None if videos is None else [v[start:start + length] for v in videos])
        assert last.frames is not None
        frames = last.frames if frames is None else torch.cat([frames, last.frames[plan.conditional:]])
        latents.append(last.video_latents)
        notes += [n for n in last.notes if n not in notes]
        for key, ms in last.timings_ms.items():
            timings[key] = timings.get(key, 0.0) + ms
    assert last is not None and frames is not None
    return WorldResult(last.video_latents, frames[:plan.total], None, None, timings, notes, chunk_latents=latents)
