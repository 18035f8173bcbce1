"""Non-causal attention on 8-bit tensor cores for Hopper: QK^T in int8 with one scale per token and head, PV in
e4m3 (fp8); a Triton kernel, its plain-PyTorch reference and the quantizers that feed it.

Why it exists: in gen-fp8 at 2 steps (Edge E7) bf16 flash-attn-4 was 13.8 of 51.3 ms of the denoise graph (H200,
0bc1011), ~670 TFLOP/s; int8 and e4m3 tensor cores have twice the bf16 peak. flash-attn-4 4.0.0b36 takes fp8 on SM100
only (its interface asserts it) and cuDNN's fp8 SDPA takes e4m3 q and k, which miss the SQNR bar (below), so this is
hand-written: one program per (BLOCK_M queries, query head), the key loop in the FlashAttention-2 order with fp32
softmax and accumulation.

Measured (H200, bench/results/latency/2026-12-03-c9f9f2c-attention-probe/): 28.5-29 dB, but 0.64 ms per Edge call at
its best tile against bf16 flash-attn-4's 0.24 ms (~250 TFLOP/s: no TMA, no warp specialisation). So the engine does
not use it; it stays, with its tests, as the numerically sound 8-bit scheme a faster kernel (TMA loads, producer /
consumer warpgroups) would have to match.

Why int8 for QK and e4m3 for PV (simulated on the CPU, then measured on the GPU by the probe): e4m3 q and k (3
mantissa bits) put the attention output at 22 dB SQNR when the softmax is peaked (QK-norm weight 2), under the 25 dB
bar (cuDNN's e4m3 SDPA measured 24.7 dB flat, 20.0 dB peaked); q and k are RMS-normalised per head, so their rows
have a small dynamic range and int8 with a per-row scale (7 bits at the row's max) gives 34-41 dB for QK alone --
SageAttention's observation.
P (in [0, 1]) and v keep e4m3: int8 would need a scale over the whole key sequence for v.

Numerics (the reference computes exactly this, up to accumulation order):
* q [B, H, Sq, d] and k [B, KH, L, d] int8 with fp32 scales [B, H, Sq] / [B, KH, L]: x ~= x_i8 * scale (per row
  absmax / 127, `quant.int8.quantize_rowwise_int8`); logits = (q_i8 . k_i8) * q_scale * k_scale / sqrt(d), exact in
  int32.
* v e4m3 with one fp32 descale per tensor (v ~= v_fp8 * descale). e4m3 is floating point, so the scale only has to
  keep |v| under 448 and well above 2^-6. `QuantizedKeyLengthAttention` finds max|v| on the device each call;
  `v_scale_bound` is a static one from the v projection's weights, for a producer that writes e4m3 v itself.
* P is scaled by 2^8 before its e4m3 cast, so probabilities down to ~1e-5 stay normal numbers (e4m3's subnormals
  start at 2^-6); the row sum l uses the same scaled P, so the factor cancels in O = acc / l.
* keys past `used[b]` are masked (the engine's [Generator | prefix | padding] rows, flash-attn-4's seqused_k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..quant.fp8 import _AMAX_FLOOR, FP8, FP8_MAX
from ..quant.int8 import quantize_rowwise_int8
from ..quant.sqnr import sqnr_db
from .attention import sdpa
from .triton_support import triton_device_problem

try:  # the kernel runs on CUDA only; CPU-only installs (CI) may have no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

INT8_MAX = 127.0
P_SCALE_LOG2 = 8  # P * 2^8 in [0, 256] before its e4m3 cast: see the module docstring
LOG2E = 1.4426950408889634
V_BOUND_MARGIN = 1.125  # an fp8 projection's rounding of its input and weights (e4m3: 2^-4 each)


def quantize_fp8(x: torch.Tensor, descale: float) -> torch.Tensor:
    """x / descale in e4m3, saturating at +-448 (a bound that holds never saturates)."""
    return (x.float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def v_scale_bound(norm_weight: torch.Tensor, v_weight: torch.Tensor, v_bias: torch.Tensor | None = None,
                  margin: float = V_BOUND_MARGIN) -> float:
    """Descale for v = W_v RMSNorm(x) (+ b) that no input can overflow: |v_j| <= ||RMSNorm(x)|| * ||W_v[j]|| + |b_j|
    and ||RMSNorm(x)|| <= sqrt(D) * max|w|, times `margin`."""
    norm_bound = math.sqrt(v_weight.shape[1]) * float(norm_weight.detach().abs().max())
    rows = norm_bound * v_weight.detach().float().norm(dim=1)
    if v_bias is not None:
        rows = rows + v_bias.detach().float().abs()
    return max(float(rows.max()) * margin, _AMAX_FLOOR) / FP8_MAX


def quantized_attention_reference(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                                  v: torch.Tensor, v_descale: float, used: torch.Tensor, *,
                                  scale: float | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel's function in PyTorch (module docstring): q [B, H, Sq, d] int8, k [B, KH, L, d] int8, v [B, KH, L,
    d] e4m3 (any strides), used [B] -> O [B, H, Sq, d]."""
    group = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    dots = q.double() @ k.double().repeat_interleave(group, dim=1).transpose(-1, -2)  # exact, as int32 is
    logits = dots.float() * (q_scale[..., :, None] * k_scale.repeat_interleave(group, dim=1)[..., None, :] * scale)
    keys = torch.arange(k.shape[2], device=q.device)
    logits = logits.masked_fill(keys >= used.to(q.device)[:, None, None, None], float("-inf"))
    p = torch.exp(logits - logits.amax(dim=-1, keepdim=True)) * 2.0**P_SCALE_LOG2
    vf = v.float().repeat_interleave(group, dim=1) * v_descale
    return ((p.to(FP8).float() @ vf) / p.sum(dim=-1, keepdim=True)).to(out_dtype)


if triton is not None:

    @triton.jit
    def _key_tile(q, qs, k_base, ks_base, v_base, start, used, m_i, l_i, acc, sk_s, sks_s, sv_s, sv_d,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, P_LOG2: tl.constexpr, MASKED: tl.constexpr):
        """One BLOCK_N tile of keys into the running (max, sum, accumulator); MASKED for the tile that holds
        `used`, whose keys past it do not count."""
        cols = start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        if MASKED:
            valid = cols < used
            kt = tl.load(k_base + cols[None, :].to(tl.int64) * sk_s + dims[:, None], mask=valid[None, :], other=0)
            ks = tl.load(ks_base + cols * sks_s, mask=valid, other=0.0)
            v = tl.load(v_base + cols[:, None].to(tl.int64) * sv_s + dims[None, :] * sv_d, mask=valid[:, None],
                        other=0.0)
        else:
            kt = tl.load(k_base + cols[None, :].to(tl.int64) * sk_s + dims[:, None])
            ks = tl.load(ks_base + cols * sks_s)
            v = tl.load(v_base + cols[:, None].to(tl.int64) * sv_s + dims[None, :] * sv_d)
        s = tl.dot(q, kt).to(tl.float32) * qs[:, None] * ks[None, :]
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None] + P_LOG2)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _quantized_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, o_ptr, used_ptr, logit_scale, vd_ptr,
                                    sq_b, sq_h, sq_s, sqs_b, sqs_h, sqs_s, sk_b, sk_h, sk_s, sks_b, sks_h, sks_s,
                                    sv_b, sv_h, sv_s, sv_d, so_b, so_h, so_s, seq_q,
                                    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, P_LOG2: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kh = h // GROUP
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        in_q = rows < seq_q
        q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_s + dims[None, :],
                    mask=in_q[:, None], other=0)
        # log2(e) / sqrt(d) folded into the query scales: the softmax runs on exp2
        qs = tl.load(qs_ptr + b.to(tl.int64) * sqs_b + h * sqs_h + rows * sqs_s, mask=in_q, other=0.0) * logit_scale
        used = tl.load(used_ptr + b)
        k_base = k_ptr + b.to(tl.int64) * sk_b + kh * sk_h
        ks_base = ks_ptr + b.to(tl.int64) * sks_b + kh * sks_h
        v_base = v_ptr + b.to(tl.int64) * sv_b + kh * sv_h
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        whole = (used // BLOCK_N) * BLOCK_N
        for start in range(0, whole, BLOCK_N):
            m_i, l_i, acc = _key_tile(q, qs, k_base, ks_base, v_base, start, used, m_i, l_i, acc, sk_s, sks_s, sv_s,
                                      sv_d, D, BLOCK_N, P_LOG2, False)
        if whole < used:
            m_i, l_i, acc = _key_tile(q, qs, k_base, ks_base, v_base, whole, used, m_i, l_i, acc, sk_s, sks_s, sv_s,
                                      sv_d, D, BLOCK_N, P_LOG2, True)
        out = acc * (tl.load(vd_ptr) / l_i)[:, None]
        tl.store(o_ptr + b.to(tl.int64) * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=in_q[:, None])

    @triton.jit
    def _rows_int8_kernel(x_ptr, q_ptr, s_ptr, rows, D: tl.constexpr, BLOCK_R: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, D)
        at = r[:, None].to(tl.int64) * D + dims[None, :]
        x = tl.load(x_ptr + at, mask=r[:, None] < rows, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 127.0
        xq = x / scale[:, None]
        # exact halves away from zero (quantize_rowwise_int8 rounds them to even: one code apart, on ties only)
        xq = tl.where(xq >= 0, tl.floor(xq + 0.5), tl.ceil(xq - 0.5))
        tl.store(q_ptr + at, tl.clamp(xq, -127.0, 127.0).to(tl.int8), mask=r[:, None] < rows)
        tl.store(s_ptr + r, scale, mask=r < rows)

    @triton.jit
    def _fp8_tensor_kernel(x_ptr, out_ptr, amax_ptr, vd_ptr, n, BLOCK: tl.constexpr):
        """x / descale in e4m3 with descale = amax / 448 read from the device (no host sync); program 0 also
        stores the descale for the attention kernel."""
        descale = tl.maximum(tl.load(amax_ptr).to(tl.float32), 1e-12) / 448.0
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, tl.clamp(x / descale, -448.0, 448.0).to(out_ptr.dtype.element_ty), mask=i < n)
        if tl.program_id(0) == 0:
            tl.store(vd_ptr, descale)


def quantized_attention_problem(device: torch.device, head_dim: int) -> str | None:
    """Why `quantized_attention` cannot run here, or None."""
    problem = triton_device_problem(device, (8, 9), "e4m3 tensor cores")
    if problem:
        return problem
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} is not 64 or 128"
    return None


def quantized_attention(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                        v: torch.Tensor, v_descale: float | torch.Tensor, used: torch.Tensor, *,
                        scale: float | None = None,
                        out: torch.Tensor | None = None, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                        num_stages: int = 2) -> torch.Tensor:
    """q [B, H, Sq, d] int8 and q_scale [B, H, Sq] fp32 (views of [B, Sq, H, ...] memory are fine), k [B, KH, L, d] int8
    and k_scale [B, KH, L], v [B, KH, L, d] e4m3 in any strides (a V^T memory, [B, KH, d, L], keeps Hopper's fp8
    MMA operand K-major), v_descale a float or a one-element fp32 device tensor, used [B] int32 keys per sequence
    -> O [B, H, Sq, d] bf16 (`out`, or a new tensor in [B, Sq, H, d] memory: the order the output projection
    reads)."""
    b, h, sq, d = q.shape
    if q.dtype != torch.int8 or k.dtype != torch.int8 or v.dtype != FP8:
        raise TypeError(f"q and k must be int8 and v {FP8}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if h % k.shape[1] or k.shape[-1] != d or v.shape != k.shape:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dimension")
    if q_scale.shape != q.shape[:3] or k_scale.shape != k.shape[:3]:
        raise ValueError(f"scales {tuple(q_scale.shape)}, {tuple(k_scale.shape)} do not match q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} without their last dimension")
    if out is None:
        out = torch.empty(b, sq, h, d, device=q.device, dtype=torch.bfloat16).transpose(1, 2)
    scale = scale if scale is not None else d**-0.5
    if not torch.is_tensor(v_descale):
        v_descale = torch.full((1,), float(v_descale), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(sq, block_m), b * h)
    _quantized_attention_kernel[grid](
        q, q_scale, k, k_scale, v, out, used, scale * LOG2E, v_descale,
        q.stride(0), q.stride(1), q.stride(2), *q_scale.stride(), k.stride(0), k.stride(1), k.stride(2),
        *k_scale.stride(),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3), out.stride(0), out.stride(1), out.stride(2), sq,
        H=h, GROUP=h // k.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, P_LOG2=P_SCALE_LOG2,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def quantize_rowwise_int8_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise_int8` as one Triton kernel for a tensor whose memory is whole rows of its last dimension
    (x.is_contiguous(), or a permutation of the leading dimensions of contiguous memory, such as the engine's q
    [B, H, G, d] view of [B, G, H, d]): outputs in x's memory order and strides."""
    d = x.shape[-1]
    perm = sorted(range(x.dim() - 1), key=lambda i: -x.stride(i))  # leading dims in memory order
    base = x.permute(*perm, x.dim() - 1)
    if not base.is_contiguous():
        raise ValueError(f"x (shape {tuple(x.shape)}, strides {x.stride()}) is not whole rows of contiguous memory")
    q, s = torch.empty_like(base, dtype=torch.int8), torch.empty(base.shape[:-1], device=x.device,
                                                                 dtype=torch.float32)
    rows = base.numel() // d
    _rows_int8_kernel[(triton.cdiv(rows, 16),)](base, q, s, rows, D=d, BLOCK_R=16, num_warps=4)
    inv = [perm.index(i) for i in range(x.dim() - 1)]
    return q.permute(*inv, x.dim() - 1), s.permute(*inv)


def quantize_fp8_tensor_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (contiguous) -> (e4m3 of x / descale, descale [1] fp32) with descale = max|x| / 448, found and applied
    on the device (no host sync, so it runs inside graph capture)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1)
    out, descale = torch.empty_like(x, dtype=FP8), torch.empty(1, device=x.device, dtype=torch.float32)
    n = x.numel()
    _fp8_tensor_kernel[(triton.cdiv(n, 4096),)](x, out, amax, descale, n, BLOCK=4096, num_warps=8)
    return out, descale


class QuantizedKeyLengthAttention:
    """`ops.attention.KeyLengthAttention` (keys [Generator | prefix | padding], sequence b attends to its first
    lengths[b]) on the int8-QK / e4m3-PV kernel: each call quantizes q and k per row and v per tensor, then one
    kernel launch serves the batch. Causal (Reasoner) calls stay on `reasoner`.

    Off CUDA it runs `quantized_attention_reference` (CPU tests of the engine path). While `recording` holds a list,
    each Generator call also computes fp32 attention on the same bf16 inputs and appends its SQNR in dB (the
    quality record of a lossy row)."""

    recording: list[float] | None = None

    def __init__(self, lengths: Sequence[int], device: torch.device, reasoner: str = "auto") -> None:
        self.lengths = list(lengths)
        self.reasoner = reasoner
        self.used = torch.stack([torch.full((), n, dtype=torch.int32, device=device) for n in self.lengths])

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if causal:
            return sdpa(q, k, v, causal=True, backend=self.reasoner)
        if q.is_cuda:
            q8, qs = quantize_rowwise_int8_cuda(q)
            k8, ks = quantize_rowwise_int8_cuda(k)
            v8, vd = quantize_fp8_tensor_cuda(v.contiguous())
            out = quantized_attention(q8, qs, k8, ks, v8, vd, self.used)
        else:
            q8, qs = quantize_rowwise_int8(q)
            k8, ks = quantize_rowwise_int8(k)
            vd = max(float(v.abs().max()), _AMAX_FLOOR) / FP8_MAX
            out = quantized_attention_reference(q8, qs, k8, ks, quantize_fp8(v, vd), vd, self.used, out_dtype=q.dtype)
        if QuantizedKeyLengthAttention.recording is not None:
            exact = exact_key_length_attention(q, k, v, self.lengths)
            QuantizedKeyLengthAttention.recording.append(sqnr_db(exact, out))
        return out


def exact_key_length_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
                               ) -> torch.Tensor:
    """fp32 attention of sequence b over its first lengths[b] keys (K/V heads shared across query-head groups)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for b, n in enumerate(lengths):
        kb, vb = (t[b : b + 1, :, :n].float().repeat_interleave(group, dim=1) for t in (k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b : b + 1].float(), kb, vb))
    return torch.cat(outs)

