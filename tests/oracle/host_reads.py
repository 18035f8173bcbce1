"""No-host-read checks of sampler loops: a torch-function recorder on CPU, sync-debug mode and capture on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from torch.overrides import TorchFunctionMode


class HostReadRecorder(TorchFunctionMode):
    """Records torch calls that read tensor data on the host or build tensors from host data.

    Either breaks CUDA-graph capture (a sync, or a host->device copy baked into the graph).
    """

    FORBIDDEN: ClassVar[set[str]] = {
        "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "numpy", "cpu",
        "tensor", "as_tensor", "from_numpy", "scalar_tensor", "is_nonzero", "equal", "allclose", "any", "all",
    }  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", str(func))
        if name in self.FORBIDDEN:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def eager_without_sync_and_captured(run: Callable[[], Any]) -> tuple[Any, Any]:
    """On CUDA: `run()` eagerly under sync-debug "error" (a host read raises), then warmed on a side stream,
    captured as one CUDA graph and replayed. Returns (eager output, replayed graph output)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.ones(1, device="cuda").sum().item()  # negative control: the mode does catch a host read
        eager = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    graph.replay()
    torch.cuda.synchronize()
    return eager, static_out
