"""The gen-fp8 Generator MLP with its activation and the down-projection's input quantization in one kernel.

In a gen-fp8 model (`wamrt quantize`, `Fp8Linear`: e4m3 weights, one dynamic scale per token) the down-projection
quantizes its input, the MLP activation, row by row: act(y) -> absmax per row -> e4m3. Compiled by Inductor that is
one looped reduction over the bf16 GEMM output y (Edge: 6,184 x 9,216 per layer and step) which reads each row twice;
on the H200 it took 101 us per call, 11.4 of Edge E6's 138.7 ms (bench/results/latency/2026-12-02-1f607ba-quant-edge/),
where reading y once and writing its e4m3 form is ~40 us of HBM traffic. `fp8_act_quant` holds the row in registers:
one read of y (gate and up halves for SwiGLU), the activation in fp32, the row's absmax, one write of e4m3 and scale.

Hand-written Triton because no library kernel does activation + per-row fp8 quantization in one pass (torchao's and
vLLM's per-token quantizers take the activation's output, which would add a write and a read of it); the rest of
the tail stays `torch._scaled_mm` and Inductor. The activation is computed in fp32 and rounded once, to e4m3 (the
unfused path rounds it to bf16 first): same function up to rounding; the GPU test compares both with fp32.

`fp8_act_quant_reference` is the same computation in plain PyTorch, what runs off CUDA (CPU tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.layer import MoTLayer
from ..quant.fp8 import _AMAX_FLOOR, FP8, FP8_MAX, Fp8Linear
from .fuse import FusedGateUp

FP8_ACTIVATION = ("fused", "inductor")


def fp8_act_quant_reference(y: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, N] (gated: [M, 2N], gate columns then up columns) -> (e4m3 [M, N], fp32 scale [M, 1]) of
    silu(gate) * up or relu(y)^2, computed in fp32; the scale maps each row's absmax onto the e4m3 max."""
    yf = y.float()
    if gated:
        gate, up = yf.chunk(2, dim=-1)
        a = F.silu(gate) * up
    else:
        a = torch.relu(yf).square()
    scale = a.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    return (a / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def act_quant(y_ptr, q_ptr, scale_ptr, n, y_row_stride, GATED: tl.constexpr, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            mask = cols < n
            src = y_ptr + row * y_row_stride
            if GATED:
                gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
                up = tl.load(src + n + cols, mask=mask, other=0.0).to(tl.float32)
                a = gate * tl.sigmoid(gate) * up
            else:
                a = tl.maximum(tl.load(src + cols, mask=mask, other=0.0).to(tl.float32), 0.0)
                a = a * a
            scale = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-12) / 448.0
            q = tl.minimum(tl.maximum(a / scale, -448.0), 448.0)
            tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(scale_ptr + row, scale)

        _kernel = act_quant
    return _kernel


@torch.library.custom_op("wamrt::fp8_act_quant", mutates_args=())
def fp8_act_quant(y: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_act_quant_reference` in one Triton kernel on CUDA (one program per row, the row in registers)."""
    if not y.is_cuda:
        return fp8_act_quant_reference(y, gated)
    import triton

    y = y if y.stride(-1) == 1 else y.contiguous()
    m, width = y.shape
    n = width // 2 if gated else width
    q = torch.empty(m, n, dtype=FP8, device=y.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=y.device)
    block = triton.next_power_of_2(n)
    # 16 warps keep a 16k-wide row at 32 fp32 values per thread (64 with SwiGLU's two halves): no spills.
    _triton_kernel()[(m,)](y, q, scale, n, y.stride(0), GATED=gated, BLOCK=block, num_warps=16 if block >= 8192 else 8)
    return q, scale


@fp8_act_quant.register_fake
def _(y, gated):
    n = y.shape[1] // 2 if gated else y.shape[1]
    return y.new_empty(y.shape[0], n, dtype=FP8), y.new_empty(y.shape[0], 1, dtype=torch.float32)


def fp8_tail_problem(layer: MoTLayer) -> str | None:
    """Why `fp8_generator_post_split` cannot serve this layer's MLP, or None."""
    mlp = layer.mlp_moe_gen
    up = getattr(mlp, "gate_up_proj", None) if mlp.gated else mlp.up_proj
    if mlp.gated and not isinstance(mlp, FusedGateUp):
        return "gate and up are not one fused projection"
    if not isinstance(mlp.down_proj, Fp8Linear) or up is None:
        return "the down-projection is not an Fp8Linear"
    if up.out_features != (2 if mlp.gated else 1) * mlp.down_proj.in_features:
        return "up-projection and down-projection widths disagree"
    return None


def fp8_generator_post_split(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer.generator_post_split(g, o)` for a gen-fp8 layer (`fp8_tail_problem(layer)` is None), with the MLP
    activation and the down-projection's input quantization in `fp8_act_quant`."""
    mlp = layer.mlp_moe_gen
    g = g + layer.self_attn.to_add_out(o.transpose(1, 2).flatten(2))
    h = layer.post_attention_layernorm_moe_gen(g)
    y = (mlp.gate_up_proj if mlp.gated else mlp.up_proj)(h)
    xq, scale = fp8_act_quant(y.flatten(0, -2), mlp.gated)
    down = mlp.down_proj
    update = down.matmul_quantized(xq, scale, y.dtype)
    return g, update.view(*y.shape[:-1], down.out_features)
