"""One-row GEMVs that do their input's elementwise work inside the K loop and the residual add after it: RMSNorm
before the q/k/v, gate/up and lm_head projections, silu(gate) * up before the down projection. For the batch-1
decode step (`reasoner/fused.py`, `OneRowDecode`).

Why: with `ops/gemv.py` on every projection, a batch-1 Nano step on the H100 read its 15 GB at a copy's rate in
5.10 of 5.73 ms of kernels. Most of the rest was ~330 small kernels between the GEMVs: residual add + RMSNorm
(0.15 ms, 72 kernels), SiLU * up (0.05 ms, 36 kernels), an add, and their launch gaps (0.25 ms idle)
(bench/results/decode/2026-12-06-328743e-nano-h100/). Inductor cannot fuse into a custom op, but every GEMV program
already streams the whole input vector through its K loop:
- `norm_gemv`: the sum of squares of x on the way, the dot products with x * norm weight in fp32, scaled by
  rsqrt(mean + eps) at the end. With the norm weight folded into the matrix (`engine.fuse.fold_reasoner_norms`) a
  program reads only x besides its weight rows, as a plain GEMV does.
- `silu_gemv`: the input is the fused gate/up output [gate | up]; each K slice computes silu(gate) * up (rounded to
  the model's dtype) before its dot products.
- `gemv_add` / `silu_gemv(residual=)`: each program adds the residual stream to its outputs, so the add after the
  o and down projections is no kernel of its own.
A first version added the residual inside the next norm GEMV instead (each program reading x, the update and the
norm weight): the kernel count fell from 475 to 323 a step but those GEMVs read ~0.34 ms slower, and the step stayed
at 5.88 ms (bench/results/decode/2026-12-06-945d6c9-nano-h100-one-row/).
The normalised input is not rounded to bf16 here (the eager norm rounds it before and after its weight), so outputs
differ from the unfused ops by about one bf16 rounding of the input: `FUSED_GEMV_ATOL` / `_RTOL`.

`pdl=True` launches the kernel with programmatic dependent launch (`triton_support.pdl_problem`). It may then start
while the kernel before it still runs: its programs read their first weight slice (`PDL_PRELOAD_SLICES`: or the
first two or four, as one tile), which no kernel writes, and wait
(`griddepcontrol.wait`) before they read the input vector or the residual. In a chain of such GEMVs the next
matrix's reads begin during the previous kernel's last wave, where most SMs sit idle, instead of after it and a
launch gap.

Off the kernel (CPU, several rows, shapes it does not take) they run the model's own modules, op by op, so the
decode stack built on them is the model's math there (its CPU tests compare it with the per-layer decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemv import GEMV_CONFIGS, gemv_problem

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
try:  # grid-dependency control (PDL); not in every Triton, and never traced unless `pdl=True`
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    gdc_launch_dependents = gdc_wait = None

# The fused kernels against the unfused ops (bf16, K up to 12,288, unit-scale inputs): one bf16 rounding of the
# normalised input, accumulated over K in fp32.
FUSED_GEMV_ATOL, FUSED_GEMV_RTOL = 3e-2, 2e-2
# With PDL: how many weight slices a program reads before it waits for the kernel before it (1, 2 or 4; fewer where K
# is shorter). A module setting, read at launch, so `wamrt bench decode` measures each in one process (+preloadN).
# 2: 0.11 ms off the batch-1 Nano step against 1, and 4 gave back most of it (H100, two runs,
# bench/results/decode/2026-12-07-d0bd6bc-nano-h100-glue/).
PDL_PRELOAD_SLICES = 2


def norm_gemv(x: torch.Tensor, norm: torch.nn.Module, weight: torch.Tensor, *, pdl: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) @ weight.T for x [..., K] (`norm` an RMSNorm, `model.norms.RMSNorm`: `weight`, `eps`). A norm whose
    weight `engine.fuse.fold_reasoner_norms` folded into the matrix is all ones, and the kernel skips it. `out`: a
    contiguous [..., N] view to write into (e.g. q's slice of a [q | k | v] buffer), returned."""
    grad = torch.is_grad_enabled() and norm.weight.requires_grad
    if gemv_problem(x, weight) is None and not grad and norm.weight.dtype == x.dtype:
        folded = getattr(norm, "folded", False)
        return _fused_gemv(x, weight, INPUT_NORM, norm_weight=None if folded else norm.weight, eps=float(norm.eps),
                           pdl=pdl, out=out)
    y = F.linear(norm(x), weight)
    return y if out is None else out.copy_(y)


def gemv_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """residual + x @ weight.T: a projection and the residual add after it."""
    if gemv_problem(x, weight) is None and residual.dtype == x.dtype:
        return _fused_gemv(x, weight, INPUT_PLAIN, residual=residual, pdl=pdl)
    return residual + F.linear(x, weight)


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, *,
              pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T (+ residual) for gate_up [..., 2I] = [gate | up], the fused gate/up output."""
    gate, up = gate_up.chunk(2, dim=-1)
    if gemv_problem(gate, weight) is None and (residual is None or residual.dtype == gate_up.dtype):
        return _fused_gemv(gate_up, weight, INPUT_SILU, residual=residual, pdl=pdl)
    out = F.linear(F.silu(gate) * up, weight)
    return out if residual is None else residual + out


INPUT_PLAIN, INPUT_SILU, INPUT_NORM = 0, 1, 2  # what the kernel computes from its input vector, slice by slice


def _fused_gemv(x, weight, kind, *, residual=None, norm_weight=None, eps=0.0, pdl=False, out=None):
    n, k = weight.shape
    if pdl and PDL_PRELOAD_SLICES not in (1, 2, 4):  # the first tile's width is a power of two
        raise ValueError(f"PDL_PRELOAD_SLICES: 1, 2 or 4, got {PDL_PRELOAD_SLICES!r}")
    if out is None:
        out = torch.empty(n, dtype=x.dtype, device=x.device)
    elif out.numel() != n or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: a contiguous {x.dtype} view of {n} elements, got {out.dtype} {list(out.shape)}")
    else:
        out = out.view(n)
    flat = x.reshape(x.shape[-1])
    _fused_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        flat, weight, out, flat if residual is None else residual.reshape(n),
        flat if norm_weight is None else norm_weight, n, eps, k, INPUT=kind, HAS_RESIDUAL=residual is not None,
        HAS_NORM_WEIGHT=norm_weight is not None, PDL=pdl, PRELOAD=PDL_PRELOAD_SLICES if pdl else 0,
        **({"launch_pdl": True} if pdl else {}))
    return out.reshape(*x.shape[:-1], n)


if triton is not None:
    @triton.jit
    def _input_slice(acc, squares, w, x_ptr, nw_ptr, out_ptr, k0, cols, K: tl.constexpr, INPUT: tl.constexpr,
                     HAS_NORM_WEIGHT: tl.constexpr):
        """One BLOCK_K slice of the K loop: the input slice computed from x, the dot products accumulated."""
        if INPUT == 1:  # [gate | up]: silu(gate) * up, rounded to the model's dtype as the eager product is
            gate = tl.load(x_ptr + k0 + cols).to(tl.float32)
            up = tl.load(x_ptr + K + k0 + cols).to(tl.float32)
            xs = (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            xs = tl.load(x_ptr + k0 + cols).to(tl.float32)
        if INPUT == 2:  # RMSNorm: the sum of squares on the way, the scale after the loop
            squares += xs * xs
            if HAS_NORM_WEIGHT:
                xs = xs * tl.load(nw_ptr + k0 + cols).to(tl.float32)
        acc += w.to(tl.float32) * xs[None, :]
        return acc, squares

    @triton.autotune(configs=GEMV_CONFIGS,
                     key=["n", "K", "INPUT", "HAS_RESIDUAL", "HAS_NORM_WEIGHT", "PDL", "PRELOAD"])
    @triton.jit
    def _fused_gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, n, eps, K: tl.constexpr, INPUT: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr, PDL: tl.constexpr,
                           PRELOAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        live = (rows < n)[:, None]
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        first_y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        first_squares = 0.0
        if PDL:
            gdc_launch_dependents()
            # the first PRELOAD weight slices, as one tile, before the wait: weights are no kernel's output
            FIRST: tl.constexpr = PRELOAD * BLOCK_K if PRELOAD * BLOCK_K <= K else BLOCK_K
            wide = tl.arange(0, FIRST)
            w_first = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + wide[None, :], mask=live, other=0.0,
                              eviction_policy="evict_first")
            gdc_wait()
            first, wide_squares = _input_slice(tl.zeros((BLOCK_N, FIRST), dtype=tl.float32),
                                               tl.zeros((FIRST,), dtype=tl.float32), w_first, x_ptr, nw_ptr, out_ptr, 0,
                                               wide, K, INPUT, HAS_NORM_WEIGHT)
            first_y = tl.sum(first, axis=1)
            first_squares = tl.sum(wide_squares, axis=0)
            for k0 in range(FIRST, K, BLOCK_K):
                w = tl.load(w_ptrs + k0, mask=live, other=0.0, eviction_policy="evict_first")
                acc, squares = _input_slice(acc, squares, w, x_ptr, nw_ptr, out_ptr, k0, cols, K, INPUT,
                                            HAS_NORM_WEIGHT)
        else:
            for k0 in range(0, K, BLOCK_K):
                w = tl.load(w_ptrs + k0, mask=live, other=0.0, eviction_policy="evict_first")
                acc, squares = _input_slice(acc, squares, w, x_ptr, nw_ptr, out_ptr, k0, cols, K, INPUT,
                                            HAS_NORM_WEIGHT)
        y = tl.sum(acc, axis=1) + first_y
        if INPUT == 2:
            y = y * tl.rsqrt((tl.sum(squares, axis=0) + first_squares) / K + eps)
        if HAS_RESIDUAL:  # the projection rounded, then the add rounded: the eager ops' two roundings
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + rows, mask=rows < n).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rows < n)


__all__ = ["FUSED_GEMV_ATOL", "FUSED_GEMV_RTOL", "gemv_add", "norm_gemv", "silu_gemv"]
