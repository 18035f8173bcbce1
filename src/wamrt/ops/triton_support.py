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


def pdl_problem(device: torch.device) -> str | None:
    """Why a kernel cannot be launched with programmatic dependent launch (PDL) on `device`, or None. Under PDL a kernel
    may start while the one before it on the stream still runs: it reads its weights, then waits
    (`griddepcontrol.wait`) before it reads what earlier kernels wrote or writes anything. Hopper or newer, and a
    Triton that exposes the grid-dependency instructions."""
    problem = triton_device_problem(device, (9, 0), "programmatic dependent launch")
    if problem:
        return problem
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return "this Triton has no grid-dependency control (triton.language.extra.cuda.gdc_wait)"
    return None
