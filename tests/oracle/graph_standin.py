"""A captured CUDA graph's stand-in on the CPU, for the engine's graph path (capture bookkeeping, static inputs,
the K/V arena, replays) without a GPU."""

from __future__ import annotations

from typing import Any


class Rerun:
    """Stands in for a captured CUDA graph: replay re-runs the captured closure on the same static buffers
    and writes the same output tensors. An input the replay path forgets to refresh (K/V, rope, masks,
    latents) then gives a stale result, as it would on the GPU."""

    def __init__(self, run, outputs) -> None:
        self.run, self.outputs = run, outputs

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.run(), strict=True):
            dst.copy_(src)


def record_by_rerun(entry: Any, run) -> Any:
    """An `Engine._record` for the CPU: run the loop once and stand a `Rerun` in for its graph."""
    outputs = run()
    entry.graph = Rerun(run, outputs)
    return outputs
