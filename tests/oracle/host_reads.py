"""A torch-function recorder for "no host reads" checks of sampler steps on CPU (test-only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

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
