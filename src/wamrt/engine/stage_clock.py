"""Stage times of a request batch that cost no host sync.

A `torch.cuda.synchronize()` after each stage made every stage's time exact but kept the host idle while the GPU
worked: the request's host work after the VAE encode (tokens, noise, positions, the graph's inputs: ~1-2 ms at Edge)
waited for the encode instead of running beside it. On CUDA a stage is timed by two events on the stream that runs
it, read after the batch's one final sync: the GPU's span of the stage. Off CUDA, wall time.
"""

from __future__ import annotations

import time

import torch


class StageClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: dict[str, list] = {}

    def start(self, stage: str, stream: torch.cuda.Stream | None = None) -> None:
        self._marks[stage] = [self._mark(stream), None]

    def stop(self, stage: str, stream: torch.cuda.Stream | None = None) -> None:
        self._marks[stage][1] = self._mark(stream)

    def ms(self) -> dict[str, float]:
        """Each stopped stage's milliseconds; on CUDA only once the stages' streams are synchronized."""
        out = {}
        for stage, (begin, end) in self._marks.items():
            if end is not None:
                out[stage] = begin.elapsed_time(end) if self.cuda else 1e3 * (end - begin)
        return out

    def _mark(self, stream: torch.cuda.Stream | None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event
