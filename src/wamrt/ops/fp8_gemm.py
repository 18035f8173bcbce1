"""The e4m3 GEMM with per-token and per-channel scales (`quant.fp8.Fp8Linear`'s function) as a Triton TMA kernel.

Why it exists beside cuBLAS (`torch._scaled_mm`, rowwise): a GEMM of our own is where epilogues can go (the q/k/v
head epilogue, `engine.qkv_epilogue.fp8_qkv_heads_into`), and at 128x256 tiles it measured level with cuBLAS or
faster at some Generator shapes (H200, bench/results/latency/2026-12-03-977c274-triton-gemm/, made by
`git show 76ddc14:scripts/fp8_gemm_probe.py`: Edge down-projection 0.157 vs 0.172 ms, Nano's 0.461 vs 0.480 ms with
cuBLAS's fast accumulation; at Edge's up-projection cuBLAS won). In the engine's E7 row it bought nothing end to
end, so it is opt-in (`EngineConfig.fp8_triton_gemms`).

Numerics: Triton's fp8 dot on Hopper leaves the partial sums in the tensor cores' reduced-precision accumulator across
K (cuBLAS's `use_fast_accum` does the same; its default promotes them to fp32 every 128 elements); then
acc * x_scale[m] * w_scale[n] in fp32, rounded once to bf16. Measured against the fp32 function: 1.9e-3 (K 2,048)
to 2.8e-3 (K 9,216) relative L2, as cuBLAS's fast mode, against 1.7e-3 for its precise mode (GPU test).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_support import triton_device_problem

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernel
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the install
    triton = None

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 128
    group_m: int = 8  # row tiles walked together, so neighbouring programs share weight tiles in L2
    warps: int = 8
    stages: int = 3


DEFAULT_TILES = TileConfig()


def fp8_gemm_problem(m: int, n: int, k: int, device: torch.device) -> str | None:
    """Why `fp8_gemm` cannot run this GEMM here, or None."""
    problem = triton_device_problem(device, (9, 0), "the kernel's TMA loads (Hopper)")
    if problem:
        return problem
    if k % 16 or n % 16:
        return f"K ({k}) and N ({n}) must be multiples of 16 (TMA row strides)"
    return None


if triton is not None:

    @triton.jit
    def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's output tile, walked in column strips GROUP_M row tiles tall (weight tiles reused in L2)."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * grid_n
        first_m = (pid // per_group) * GROUP_M
        size_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @triton.jit
    def _fp8_gemm_kernel(desc_x, xs_ptr, desc_w, ws_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        m0, n0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            acc = tl.dot(desc_x.load([m0, k]), desc_w.load([n0, k]).T, acc)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        in_m = rows < M
        in_n = cols < N
        xs = tl.load(xs_ptr + rows, mask=in_m, other=0.0)
        ws = tl.load(ws_ptr + cols, mask=in_n, other=0.0)
        y = acc * xs[:, None] * ws[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])


def fp8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
                       ) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M, 1] fp32, wq [N, K] e4m3, w_scale [N] fp32 -> bf16 [M, N], fp32 math."""
    return ((xq.float() @ wq.float().t()) * x_scale.float() * w_scale.float()[None, :]).to(torch.bfloat16)


def _launch(xq, x_scale, wq, w_scale, tiles: TileConfig) -> torch.Tensor:
    m, k = xq.shape
    n = wq.shape[0]
    desc_x = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [tiles.block_m, tiles.block_k])
    desc_w = TensorDescriptor(wq, [n, k], [wq.stride(0), 1], [tiles.block_n, tiles.block_k])
    out = torch.empty(m, n, device=xq.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _fp8_gemm_kernel[grid](desc_x, x_scale, desc_w, w_scale, out, m, n, k, BLOCK_M=tiles.block_m,
                           BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                           num_warps=tiles.warps, num_stages=tiles.stages)
    return out


@torch.library.custom_op("wamrt::fp8_gemm", mutates_args=())
def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`fp8_gemm_reference` as the Triton kernel on a Hopper GPU (`fp8_gemm_problem` None), else the reference.
    A custom op, so Inductor compiles the layer around it rather than into it."""
    if fp8_gemm_problem(xq.shape[0], wq.shape[0], xq.shape[1], xq.device) is not None:
        return fp8_gemm_reference(xq, x_scale, wq, w_scale)
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    return _launch(xq, x_scale.reshape(-1).contiguous(), wq.contiguous(), w_scale.contiguous(), DEFAULT_TILES)


@fp8_gemm.register_fake
def _(xq, x_scale, wq, w_scale):
    return xq.new_empty(xq.shape[0], wq.shape[0], dtype=torch.bfloat16)
