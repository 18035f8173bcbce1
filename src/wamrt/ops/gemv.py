"""One activation row times a weight matrix (a GEMV) in Triton: the projections of a batch-1 decode step.

Why a kernel of our own: a batch-1 Nano decode step is 15.14 GB of weight reads, and on the H100 cuBLAS ran the
step's GEMVs at ~93 % of a device-to-device copy's bandwidth (bench/results/decode/2026-12-06-0230412-nano-h100/).
Its gate/up GEMVs were at the copy's speed. down_proj (K = 12,288) and o_proj ran split-K, which adds a reduction
kernel, and the small q/k/v matrix lost time to its tail. Here every program reads BLOCK_N whole weight rows in
BLOCK_K slices and accumulates in fp32. The grid is N / BLOCK_N programs with no split over K, so each output is
written once. The tile is autotuned per (N, K). On its first GPU run it read `lm_head` at 3.19 TB/s against
cuBLAS's 2.86 (bench/results/decode/2026-12-06-dfeffd6-nano-h100/); whether it wins on every projection is what
`wamrt bench decode`'s `gemv` rows measure. Nothing uses it unless asked (`use_gemv_kernel`).

Where the kernel cannot run (CPU, more than one row, a K that BLOCK_K does not divide) `GemvLinear` is F.linear.
The custom op keeps torch.compile from tracing into Triton: Inductor calls it as an opaque kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .triton_support import triton_device_problem

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
GEMV_CONFIGS: list = []

K_MULTIPLE = 1024  # every BLOCK_K below divides it: no masked loads along K


def gemv_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors, or None."""
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return "autograd is on: the kernel has no backward (decode runs under no_grad)"
    problem = triton_device_problem(x.device)
    if problem:
        return problem
    if x.numel() != x.shape[-1]:
        return f"{x.numel() // x.shape[-1]} rows: the kernel takes one"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"{x.dtype} x {weight.dtype}: the kernel takes bf16 or fp16, both the same"
    if weight.shape[1] % K_MULTIPLE or not weight.is_contiguous():
        return f"K = {weight.shape[1]}: the kernel takes contiguous weights with K a multiple of {K_MULTIPLE}"
    return None


def _gemv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x.reshape(k), weight, out, n, k)
    return out


if triton is not None:
    # (BLOCK_N, BLOCK_K, warps): autotuned per shape; ops/gemv_fused.py's kernels share them
    GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
                    for bn, bk, w in ((1, 1024, 4), (2, 1024, 4), (2, 1024, 8), (4, 512, 4), (4, 1024, 4),
                                      (4, 1024, 8), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 256, 8))]

    @triton.autotune(configs=GEMV_CONFIGS, key=["n", "K"])
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, n, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        live = (rows < n)[:, None]
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K is a compile-time constant: a loop the compiler sees whole
            w = tl.load(w_ptrs + k0, mask=live, other=0.0, eviction_policy="evict_first")  # read once: keep L2 for x
            xs = tl.load(x_ptr + k0 + cols)
            acc += w.to(tl.float32) * xs.to(tl.float32)[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < n)


@torch.library.custom_op("wamrt::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] -> [..., N]."""
    return _gemv_triton(x, weight).reshape(*x.shape[:-1], weight.shape[0])


@gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class GemvLinear(nn.Linear):
    """nn.Linear whose one-row products go to the Triton GEMV; everything else (prefill, batches, CPU) to F.linear.
    A class swap on an existing module (`use_gemv_kernel`): the weights stay where they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_problem(x, self.weight) is not None:
            return F.linear(x, self.weight, self.bias)
        out = gemv_op(x, self.weight)
        return out if self.bias is None else out + self.bias


def use_gemv_kernel(module: nn.Module, min_numel: int = 0) -> int:
    """Serve every plain nn.Linear under `module` with at least `min_numel` weights through `GemvLinear`
    (idempotent); returns how many were swapped. Quantized layers (other classes) keep their own kernels.
    min_numel leaves the small matrices to what the compiler picks for them (`wamrt bench decode` measures both)."""
    swapped = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.numel() >= min_numel:
            sub.__class__ = GemvLinear
            swapped += 1
    return swapped


def undo_gemv_kernel(module: nn.Module) -> int:
    """The swap undone: every GemvLinear under `module` is an nn.Linear again; returns how many."""
    undone = 0
    for sub in module.modules():
        if type(sub) is GemvLinear:
            sub.__class__ = nn.Linear
            undone += 1
    return undone
