"""Process-group plumbing for one host: environment, rendezvous, rank -> device.

Every process this package starts (and the process that starts them) gets NVLink multicast switched
off in NCCL, PyTorch symmetric memory and NVSHMEM: on shared multi-GPU hosts a program that uses it can
take the host's GPUs out of service. Set here, before any process group exists, and inherited by the
workers, which set it again themselves.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A collective waits this long for its peers (first requests compile and capture graphs on every rank).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=15)


# torch 2.13 renames all_gather_into_tensor (the H200 image has 2.11).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def no_multicast_env() -> None:
    """Force the multicast switches off in this process's environment (and so in its children)."""
    os.environ.update(NO_MULTICAST)


def rank_device(device: str, rank: int) -> torch.device:
    """'cuda' -> cuda:<rank> (one GPU per rank); 'cpu' -> cpu (gloo, for tests)."""
    if device.startswith("cuda"):
        return torch.device("cuda", rank)
    return torch.device(device)


def init_group(rank: int, world: int, port: int, device: torch.device) -> None:
    """Join the default process group: NCCL for GPUs, gloo on the CPU."""
    no_multicast_env()
    url = f"tcp://127.0.0.1:{port}"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=url, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
