"""The gen-fp8 Generator layer with each fp8 GEMM's input quantization fused into the op before it.

In a gen-fp8 model (`wamrt quantize`, `Fp8Linear`: e4m3 weights, one dynamic scale per token) every Generator GEMM
quantizes its input row by row (absmax per row -> e4m3). Compiled by Inductor, around three of the four GEMMs that
costs an extra reduction pass: H200, Edge E6 at 1f607ba (bench/results/latency/2026-12-02-1f607ba-quant-edge/),
138.7 ms per request, of which
* 11.4 ms: the MLP activation + the down-projection's quantization, a looped reduction over the bf16 up-projection
  output (6,184 x 9,216 per layer and step) that reads every row twice: 101 us a call, where one read of it and one
  write of its e4m3 form is ~40 us of HBM traffic;
* 9.1 ms: the input norm before q/k/v and the post-attention norm before the up-projection, each a residual add +
  mean-square reduction kernel followed by a second reduction kernel for the normed row's absmax and quantization.

Here each is one pass with the row in registers: `fp8_act_quant` (SwiGLU or ReLU^2, absmax, e4m3; without an
activation it also quantizes the attention output for the output projection) and
`fp8_add_rms_norm_quant` (residual add, RMSNorm, absmax, e4m3), Triton kernels behind custom ops, so Inductor
compiles the rest of the layer around them; the GEMMs stay `torch._scaled_mm`. Hand-written because no library
kernel fuses the activation or the norm with per-row fp8 quantization (torchao's and vLLM's per-token quantizers
take the activation's output: one more write and read of it). Computed in fp32, rounded to bf16 where the residual
stream and the normed row are (the unfused layer rounds the activation to bf16 too): the same function up to
rounding; the GPU tests compare both with the layer's own modules and with bf16.

The `*_reference` functions are the same computations in plain PyTorch, what runs off CUDA (CPU tests).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

try:  # the kernels run on CUDA only; PyTorch's CUDA builds bring Triton, CPU builds may not
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from ..model.layer import MoTLayer
from ..model.rope import Rope
from ..quant.fp8 import _AMAX_FLOOR, FP8, FP8_MAX, Fp8Linear, quantize_rowwise_fp8
from .fuse import FusedGateUp, FusedGeneratorQKV

FP8_QUANTIZE = ("fused", "inductor")
# The fused layer's four GEMM call sites; an engine runs the ones it names on `ops.fp8_gemm` (Triton), the rest on
# cuBLAS (`torch._scaled_mm`).
GEMM_SITES = ("qkv", "out", "up", "down")
# "qkv_heads": the q/k/v GEMM with the per-head norms, RoPE and K/V stores inside (`qkv_epilogue.fp8_qkv_heads_into`).
TRITON_SITES = (*GEMM_SITES, "qkv_heads")


ACTIVATIONS = ("swiglu", "relu_sq", "none")

# Triton's Autotuner keeps the launch in progress on itself (its `nargs`, set at the start of `run` and cleared at
# the end), so two threads launching one autotuned kernel at once clobber each other: a server's background graph
# capture beside its warm-up request died in `benchmark` with "'NoneType' object is not a mapping" (H200, Nano
# gen-fp8 under a 24 GiB cap, bench/results/load/2026-12-06-c543d5c-load-plan-h200/). Launches take turns.
_AUTOTUNED_LAUNCH = threading.Lock()


def fp8_act_quant_reference(y: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, N] (swiglu: [M, 2N], gate columns then up columns) -> (e4m3 [M, N], fp32 scale [M, 1]) of
    silu(gate) * up, relu(y)^2 or y itself, computed in fp32; the scale maps each row's absmax onto the e4m3 max."""
    yf = y.float()
    if activation == "swiglu":
        gate, up = yf.chunk(2, dim=-1)
        a = F.silu(gate) * up
    elif activation == "relu_sq":
        a = torch.relu(yf).square()
    elif activation == "none":
        a = yf
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    scale = a.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    return (a / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


if triton is not None:

    @triton.jit
    def _activation(src, cols, mask, N: tl.constexpr, ACT: tl.constexpr):
        a = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:  # swiglu: a is the gate
            a = a * tl.sigmoid(a) * tl.load(src + N + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 1:  # relu_sq
            a = tl.maximum(a, 0.0)
            a = a * a
        return a

    # Autotuned per (width, activation) on the first call (the engine's warm-up, outside graph capture), over
    # one-pass (the row in registers) and two-pass (column chunks, the second pass mostly from L2) variants, with
    # one program per row (PER_SM 0) or a few per SM looping over rows (PER_SM of them per SM): the looping ones won
    # at the MLP's widths, one per row at the attention output's (H200, 6,184 rows: Edge ReLU^2 53.2 -> 45.5 us, Nano
    # SwiGLU 115.0 -> 96.2 us; bench/results/latency/2026-12-03-e625df4-act-quant-probe/, made by
    # `git show 76ddc14:scripts/act_quant_probe.py`). Every variant computes the same bits: a maximum does not depend
    # on the order it is taken in.
    @triton.autotune(configs=[triton.Config({"BLOCK": b, "PER_SM": p}, num_warps=w) for b, w, p in
                              ((1024, 4, 0), (2048, 4, 0), (2048, 8, 0), (4096, 8, 0), (16384, 16, 0), (16384, 32, 0),
                               (4096, 8, 8), (16384, 8, 4), (16384, 8, 8), (16384, 8, 16))],
                     key=["N", "ACT"])
    @triton.jit
    def _act_quant_kernel(y_ptr, q_ptr, scale_ptr, M, y_row_stride, N: tl.constexpr, ACT: tl.constexpr,
                          BLOCK: tl.constexpr, PER_SM: tl.constexpr):
        # num_stages=1: prefetching the next row (2, 3 stages) measured slower in every looping variant
        for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=1):
            src = y_ptr + row.to(tl.int64) * y_row_stride
            dst = q_ptr + row.to(tl.int64) * N
            if BLOCK >= N:
                cols = tl.arange(0, BLOCK)
                mask = cols < N
                a = _activation(src, cols, mask, N, ACT)
                scale = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-12) / 448.0
                q = tl.minimum(tl.maximum(a / scale, -448.0), 448.0)
                tl.store(dst + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
                tl.store(scale_ptr + row, scale)
            else:
                peak = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, N, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    peak = tl.maximum(peak, tl.abs(_activation(src, cols, cols < N, N, ACT)))
                scale = tl.maximum(tl.max(peak, axis=0), 1e-12) / 448.0
                for start in range(0, N, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < N
                    q = tl.minimum(tl.maximum(_activation(src, cols, mask, N, ACT) / scale, -448.0), 448.0)
                    tl.store(dst + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
                tl.store(scale_ptr + row, scale)

    @triton.jit
    def _add_norm_quant_kernel(x_ptr, u_ptr, w_ptr, s_ptr, q_ptr, scale_ptr, n, eps, HAS_UPDATE: tl.constexpr,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_UPDATE:
            x = (x.to(tl.float32) + tl.load(u_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(s_ptr.dtype.element_ty)  # the residual stream, rounded as the unfused add rounds it
            tl.store(s_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (xf * rstd * w).to(s_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + row, scale)


@torch.library.custom_op("wamrt::fp8_act_quant", mutates_args=())
def fp8_act_quant(y: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_act_quant_reference` in one Triton kernel on CUDA (one program per row). y [M, width], rows contiguous."""
    if not y.is_cuda:
        return fp8_act_quant_reference(y, activation)
    y = y if y.stride(-1) == 1 else y.contiguous()
    m, width = y.shape
    n = width // 2 if activation == "swiglu" else width
    q = torch.empty(m, n, dtype=FP8, device=y.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=y.device)
    sms = _multiprocessors(y.device)
    with _AUTOTUNED_LAUNCH:
        _act_quant_kernel[lambda meta: (min(m, meta["PER_SM"] * sms) if meta["PER_SM"] else m,)](
            y, q, scale, m, y.stride(0), N=n, ACT=ACTIVATIONS.index(activation))
    return q, scale


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@fp8_act_quant.register_fake
def _(y, activation):
    n = y.shape[1] // 2 if activation == "swiglu" else y.shape[1]
    return y.new_empty(y.shape[0], n, dtype=FP8), y.new_empty(y.shape[0], 1, dtype=torch.float32)


def fp8_add_rms_norm_quant_reference(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, eps: float
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, update [M, h] (update may be None) -> (s = x + update, e4m3 [M, h], fp32 scale [M, 1]) of the RMSNorm of s
    times `weight`, computed in fp32 and rounded to s's dtype once before it is quantized (the Nemotron flavour's
    rounding; the Qwen flavour rounds once more, inside the norm)."""
    s = x if update is None else x + update
    sf = s.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(s.dtype)
    q, scale = quantize_rowwise_fp8(y)
    return s, q, scale


@torch.library.custom_op("wamrt::fp8_add_rms_norm_quant", mutates_args=())
def fp8_add_rms_norm_quant(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_add_rms_norm_quant_reference` in one Triton kernel on CUDA (one program per row). x, update [M, h]
    contiguous; without update the first output is a copy of x (a custom op's outputs cannot alias its inputs)."""
    if not x.is_cuda:
        s, q, scale = fp8_add_rms_norm_quant_reference(x, update, weight, eps)
        return (s.clone() if update is None else s), q, scale
    x = x.contiguous()
    m, n = x.shape
    s = torch.empty_like(x) if update is not None else x.clone()
    q = torch.empty(m, n, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    u = update.contiguous() if update is not None else x
    _add_norm_quant_kernel[(m,)](x, u, weight, s, q, scale, n, eps, HAS_UPDATE=update is not None,
                                BLOCK=triton.next_power_of_2(n), num_warps=8)
    return s, q, scale


@fp8_add_rms_norm_quant.register_fake
def _(x, update, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], 1, dtype=torch.float32)


def fp8_fusion_problem(layer: MoTLayer) -> str | None:
    """Why `fp8_generator_qkv` / `fp8_generator_post_split` cannot serve this layer, or None."""
    mlp, attn = layer.mlp_moe_gen, layer.self_attn
    if mlp.gated and not isinstance(mlp, FusedGateUp):
        return "gate and up are not one fused projection"
    if not isinstance(attn, FusedGeneratorQKV):
        return "q, k and v are not one fused projection"
    up = mlp.gate_up_proj if mlp.gated else mlp.up_proj
    for name, lin in (("q/k/v", attn.add_qkv_proj), ("output", attn.to_add_out), ("up", up), ("down", mlp.down_proj)):
        if not isinstance(lin, Fp8Linear):
            return f"the {name} projection is not an Fp8Linear"
    if up.out_features != (2 if mlp.gated else 1) * mlp.down_proj.in_features:
        return "up-projection and down-projection widths disagree"
    if triton is None and up.weight.is_cuda:
        return "Triton is not installed"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _kernel(site: str, gemm_choices: frozenset[str]) -> str | None:
    """The `Fp8Linear` kernel for this call site. `gemm_choices` (an engine's): the `GEMM_SITES` that run on the Triton
    GEMM, plus "fast_accum" for cuBLAS's fast accumulation at the others (`EngineConfig.fp8_fast_accum`); neither:
    the module's own kernel."""
    if site in gemm_choices:
        return "triton"
    return "scaled_mm_fast" if "fast_accum" in gemm_choices else None


def fp8_generator_norm_quant(layer: MoTLayer, g: torch.Tensor, update: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The previous layer's residual add and the input norm, quantized for the q/k/v GEMM -> (e4m3 rows [B*G, h],
    their scales [B*G, 1], g after the add)."""
    norm = layer.input_layernorm_moe_gen
    g2, xq, scale = fp8_add_rms_norm_quant(_rows(g), None if update is None else _rows(update), norm.weight, norm.eps)
    return xq, scale, g2.view(g.shape)


def fp8_generator_projections(layer: MoTLayer, g: torch.Tensor, update: torch.Tensor | None,
                              gemm_choices: frozenset[str] = frozenset()
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The previous layer's residual add, the input norm and the q/k/v projections -> (q [B, G, H*d], k, v, g) for a
    gen-fp8 layer (`fp8_fusion_problem(layer)` is None): the add, the norm and the q/k/v GEMM's input quantization
    in `fp8_add_rms_norm_quant`. `gemm_choices`: the GEMM kernels, as `_kernel` reads them."""
    attn = layer.self_attn
    xq, scale, g2 = fp8_generator_norm_quant(layer, g, update)
    qkv = attn.add_qkv_proj.matmul_quantized(xq, scale, g.dtype, _kernel("qkv", gemm_choices))
    return (*qkv.view(*g.shape[:-1], -1).split(attn.qkv_sizes, dim=-1), g2)


def fp8_generator_qkv(layer: MoTLayer, g: torch.Tensor, update: torch.Tensor | None, rope: Rope,
                      gemm_choices: frozenset[str] = frozenset()
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_generator_projections`, then the per-head norms and RoPE: `layer.generator_pre` after the residual add
    -> (q, k, v, g)."""
    q, k, v, g2 = fp8_generator_projections(layer, g, update, gemm_choices)
    return (*layer.self_attn.generator_heads(q, k, v, rope), g2)


def fp8_generator_post_split(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor,
                             gemm_choices: frozenset[str] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer.generator_post_split(g, o)` for a gen-fp8 layer (`fp8_fusion_problem(layer)` is None): the residual
    add, the norm and the up-projection's input quantization in `fp8_add_rms_norm_quant`, the MLP activation and
    the down-projection's input quantization in `fp8_act_quant`, and the attention output's quantization for the
    output projection in `fp8_act_quant` without activation. `gemm_choices` as `fp8_generator_projections`'s."""
    mlp, norm = layer.mlp_moe_gen, layer.post_attention_layernorm_moe_gen
    oq, o_scale = fp8_act_quant(_rows(o.transpose(1, 2).flatten(2)), "none")
    attn_out = layer.self_attn.to_add_out.matmul_quantized(oq, o_scale, g.dtype, _kernel("out", gemm_choices))
    g2, hq, h_scale = fp8_add_rms_norm_quant(_rows(g), attn_out, norm.weight, norm.eps)
    up = mlp.gate_up_proj if mlp.gated else mlp.up_proj
    y = up.matmul_quantized(hq, h_scale, g.dtype, _kernel("up", gemm_choices))
    xq, scale = fp8_act_quant(y, "swiglu" if mlp.gated else "relu_sq")
    update = mlp.down_proj.matmul_quantized(xq, scale, g.dtype, _kernel("down", gemm_choices))
    return g2.view(g.shape), update.view(g.shape)
