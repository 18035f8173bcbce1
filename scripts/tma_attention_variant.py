"""Experimental, for scripts/fp8_attention_probe.py (`--tma-configs`): the int8-QK / e4m3-PV attention of
`wamrt.ops.quantized_attention` with its q, k and V^T tiles loaded by TMA (Triton host-side tensor descriptors) and
the key loop software-pipelined by `tl.range`.

Not measured yet. Written after the package's pointer-load kernel measured 0.64 ms per Edge call against bf16
flash-attn-4's 0.24 ms (bench/results/latency/2026-12-03-c9f9f2c-attention-probe/); it moves into the package only
if it wins there. Same numerics as `quantized_attention_reference` (the probe reports both SQNRs).

TMA needs 16-byte row strides: q rows are H * d bytes, k rows d bytes, and V^T rows are padded to a multiple of 16
keys (`vt_padded`). Tiles that run past a sequence's keys read the next head's rows or TMA's zero fill; those keys
are masked out of the softmax, and a zero probability times a finite value adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from wamrt.ops.quantized_attention import FP8, LOG2E, P_SCALE_LOG2


@triton.jit
def _tma_attention_kernel(desc_q, qs_ptr, desc_k, ks_ptr, desc_vt, o_ptr, used_ptr, logit_scale, vd_ptr,
                          sqs_b, sqs_h, sqs_s, sks_b, sks_h, sks_s, so_b, so_h, so_s, seq_q, kv_len,
                          H: tl.constexpr, KH: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_LOG2: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kh = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    in_q = rows < seq_q
    q = desc_q.load([b * seq_q + m0, h * D])
    qs = tl.load(qs_ptr + b.to(tl.int64) * sqs_b + h * sqs_h + rows * sqs_s, mask=in_q, other=0.0) * logit_scale
    used = tl.load(used_ptr + b)
    k_row = (b * KH + kh) * kv_len
    vt_row = (b * KH + kh) * D
    ks_base = ks_ptr + b.to(tl.int64) * sks_b + kh * sks_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, used, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = cols < used
        k = desc_k.load([k_row + start, 0])
        ks = tl.load(ks_base + cols * sks_s, mask=valid, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qs[:, None] * ks[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None] + P_LOG2)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = desc_vt.load([vt_row, start])
        acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc * alpha[:, None])
        m_i = m_new
    out = acc * (tl.load(vd_ptr) / l_i)[:, None]
    dims = tl.arange(0, D)
    tl.store(o_ptr + b.to(tl.int64) * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=in_q[:, None])


def vt_padded(v8: torch.Tensor) -> torch.Tensor:
    """e4m3 v [B, KH, L, d] -> V^T [B, KH, d, L16] with L16 the next multiple of 16 (TMA row strides)."""
    b, kh, length, d = v8.shape
    out = torch.zeros(b, kh, d, -(-length // 16) * 16, device=v8.device, dtype=FP8)
    out[..., :length] = v8.transpose(-1, -2)
    return out


def tma_attention(q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, vt16: torch.Tensor,
                  v_descale: torch.Tensor, used: torch.Tensor, *, block_m: int = 128, block_n: int = 128,
                  num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """q8 [B, H, G, d] int8 as a view of [B, G, H, d] memory, qs [B, H, G], k8 [B, KH, L, d] int8 contiguous, ks
    [B, KH, L], vt16 from `vt_padded`, v_descale [1] fp32, used [B] int32 -> O [B, H, G, d] bf16 in [B, G, H, d]
    memory."""
    b, h, sq, d = q8.shape
    kh, length = k8.shape[1], k8.shape[2]
    q_rows = q8.transpose(1, 2)
    if not q_rows.is_contiguous() or not k8.is_contiguous() or not vt16.is_contiguous():
        raise ValueError("q8 must view [B, G, H, d] memory; k8 and vt16 must be contiguous")
    desc_q = TensorDescriptor(q_rows.reshape(b * sq, h * d), [b * sq, h * d], [h * d, 1], [block_m, d])
    desc_k = TensorDescriptor(k8.reshape(b * kh * length, d), [b * kh * length, d], [d, 1], [block_n, d])
    desc_vt = TensorDescriptor(vt16.reshape(b * kh * d, vt16.shape[-1]), [b * kh * d, length], [vt16.shape[-1], 1],
                               [d, block_n])
    out = torch.empty(b, sq, h, d, device=q8.device, dtype=torch.bfloat16).transpose(1, 2)
    _tma_attention_kernel[(triton.cdiv(sq, block_m), b * h)](
        desc_q, qs, desc_k, ks, desc_vt, out, used, d**-0.5 * LOG2E, v_descale, *qs.stride(), *ks.stride(),
        out.stride(0), out.stride(1), out.stride(2), sq, length, H=h, KH=kh, GROUP=h // kh, D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, P_LOG2=P_SCALE_LOG2, num_warps=num_warps, num_stages=num_stages,
    )
    return out
