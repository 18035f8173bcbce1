"""Whether a Triton kernel can run on a device: the check every kernel module's `*_problem` starts with."""

from __future__ import annotations

import importlib.util

import torch

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # CUDA builds of torch ship it; CPU builds may not


def triton_device_problem(device: torch.device, capability: tuple[int, int] | None = None, need: str = ""
                          ) -> str | None:
    """Why a Triton kernel cannot run on `device`, or None: not CUDA, no Triton, or a compute capability below
    `capability` (`need` names what needs it, for the message)."""
    if device.type != "cuda":
        return "the Triton kernel needs a CUDA device"
    if not TRITON_INSTALLED:
        return "Triton is not installed"
    if capability is not None and torch.cuda.get_device_capability(device) < capability:
        return f"{need} need compute capability {capability[0]}.{capability[1]} or newer"
    return None
