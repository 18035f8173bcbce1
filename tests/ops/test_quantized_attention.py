"""The int8-QK / e4m3-PV attention (`ops/quantized_attention.py`): the reference's numerics and quantizers on the
CPU, the op on the engine's [Generator | prefix | padding] layout, and on CUDA the Triton kernels against the
reference (a GPU test in `scripts/gpu_run.sh kernel-tests`)."""

from __future__ import annotations

import math

import pytest
import torch

from wamrt.ops.quantized_attention import (
    FP8,
    FP8_MAX,
    V_BOUND_MARGIN,
    QuantizedKeyLengthAttention,
    exact_key_length_attention,
    quantize_fp8,
    quantized_attention_reference,
    v_scale_bound,
)
from wamrt.quant.int8 import quantize_rowwise_int8
from wamrt.quant.sqnr import SQNR_BAR_DB, sqnr_db

KERNEL_VS_REFERENCE_DB = 30.0  # same function, other accumulation order and fp32 division rounding
INT8_STEP_RTOL = 0.5 / 127 + 1e-6  # rounding to the nearest of 255 levels over [-absmax, absmax]


def _inputs(heads=4, kv_heads=2, g=200, prefix=24, w=1.0, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def normed(*shape):
        x = torch.randn(*shape, generator=gen, device=device)
        return (x * torch.rsqrt(x.square().mean(-1, keepdim=True)) * w).to(torch.bfloat16)

    q = normed(2, g, heads, 128).transpose(1, 2)  # the engine's [B, H, G, d] view of [B, G, H, d]
    k = normed(2, kv_heads, g + prefix, 128)
    v = torch.randn(2, kv_heads, g + prefix, 128, generator=gen, device=device).to(torch.bfloat16)
    lengths = [g + prefix, g + prefix // 3]
    k[1, :, lengths[1]:] = 3.0  # padding keys hold finite junk, which must not count
    v[1, :, lengths[1]:] = 3.0
    return q, k, v, lengths


def test_int8_rows_round_within_half_a_step_and_keep_the_row_max():
    x = torch.randn(3, 5, 128) * torch.logspace(-3, 3, 5)[None, :, None]
    q, scale = quantize_rowwise_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 5)
    assert torch.equal(q.abs().amax(dim=-1), torch.full((3, 5), 127, dtype=torch.int8))
    err = (q.float() * scale[..., None] - x).abs().amax(dim=-1)
    assert torch.all(err <= INT8_STEP_RTOL * x.abs().amax(dim=-1))
    zero_q, zero_scale = quantize_rowwise_int8(torch.zeros(2, 128))
    assert torch.equal(zero_q, torch.zeros_like(zero_q)) and torch.all(zero_scale > 0)


def test_v_scale_bound_holds_for_every_input():
    gen = torch.Generator().manual_seed(1)
    d_model, d_v = 256, 64
    norm_w, v_w, v_b = torch.rand(d_model, generator=gen) * 2, torch.randn(d_v, d_model, generator=gen), None
    descale = v_scale_bound(norm_w, v_w, v_b)
    for x in (torch.randn(500, d_model, generator=gen), torch.eye(d_model) * 1e3):  # incl. all energy in one channel
        normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True)) * norm_w
        assert (normed @ v_w.T).abs().max() <= descale * FP8_MAX
    # with a constant norm weight the bound is reached: the input along the largest weight row
    flat = torch.full((d_model,), 1.5)
    row = v_w[int(v_w.norm(dim=1).argmax())][None]
    normed = row * torch.rsqrt(row.square().mean(-1, keepdim=True)) * flat
    assert (normed @ v_w.T).abs().max() >= v_scale_bound(flat, v_w) * FP8_MAX / V_BOUND_MARGIN * (1 - 1e-5)


@pytest.mark.parametrize("w", [1.0, 2.0])
def test_reference_clears_the_sqnr_bar_where_fp8_qk_does_not(w):
    q, k, v, lengths = _inputs(w=w)
    used = torch.tensor(lengths)
    exact = exact_key_length_attention(q, k, v, lengths)
    q8, qs = quantize_rowwise_int8(q)
    k8, ks = quantize_rowwise_int8(k)
    vd = float(v.abs().max()) / FP8_MAX
    ours = quantized_attention_reference(q8, qs, k8, ks, quantize_fp8(v, vd), vd, used)
    assert sqnr_db(exact, ours) >= SQNR_BAR_DB + 2
    # e4m3 q and k (what cuDNN's and FlashAttention-3's fp8 forward take): under the bar once the softmax is peaked
    qd, kd = (float(t.abs().max()) / FP8_MAX for t in (q, k))
    fp8_qk = exact_key_length_attention(quantize_fp8(q, qd).float() * qd, quantize_fp8(k, kd).float() * kd,
                                        v.float(), lengths)
    if w == 2.0:
        assert sqnr_db(exact, fp8_qk) < SQNR_BAR_DB


def test_padding_keys_do_not_count():
    q, k, v, lengths = _inputs()
    used = torch.tensor(lengths)
    q8, qs = quantize_rowwise_int8(q)
    k8, ks = quantize_rowwise_int8(k)
    v8 = quantize_fp8(v, 0.05)
    out = quantized_attention_reference(q8, qs, k8, ks, v8, 0.05, used)
    k8[1, :, lengths[1]:] = 127  # junk that would dominate the softmax if it were attended to
    v8[1, :, lengths[1]:] = torch.tensor(FP8_MAX).to(FP8)
    assert torch.equal(quantized_attention_reference(q8, qs, k8, ks, v8, 0.05, used), out)


def test_op_on_cpu_runs_the_reference_and_records_sqnr():
    q, k, v, lengths = _inputs(w=2.0)
    op = QuantizedKeyLengthAttention(lengths, torch.device("cpu"))
    QuantizedKeyLengthAttention.recording = []
    try:
        out = op(q, k, v, causal=False)
        recorded = list(QuantizedKeyLengthAttention.recording)
    finally:
        QuantizedKeyLengthAttention.recording = None
    assert out.shape == q.shape and out.dtype == q.dtype
    assert len(recorded) == 1 and recorded[0] >= SQNR_BAR_DB
    assert math.isclose(recorded[0], sqnr_db(exact_key_length_attention(q, k, v, lengths), out), rel_tol=1e-9)
    op(q, k, v, causal=False)  # recording off: nothing kept
    assert QuantizedKeyLengthAttention.recording is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_triton_kernel_and_quantizers_match_the_reference(heads, kv_heads):
    from wamrt.ops.quantized_attention import (
        quantize_fp8_tensor_cuda,
        quantize_rowwise_int8_cuda,
        quantized_attention,
    )

    q, k, v, lengths = _inputs(heads, kv_heads, g=3092, prefix=125, w=2.0, device="cuda")
    used = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    q8, qs = quantize_rowwise_int8_cuda(q)
    want_q8, want_qs = quantize_rowwise_int8(q)
    assert q8.shape == q.shape and q8.stride() == q.stride()  # the view's layout kept
    assert (q8.int() - want_q8.int()).abs().max() <= 1 and torch.allclose(qs, want_qs, rtol=1e-6)
    k8, ks = quantize_rowwise_int8_cuda(k)
    v8, vd = quantize_fp8_tensor_cuda(v)
    assert math.isclose(float(vd), float(v.abs().max()) / FP8_MAX, rel_tol=1e-6)
    want = quantized_attention_reference(q8, qs, k8, ks, v8, float(vd), used)
    for v_in in (v8, v8.transpose(-1, -2).contiguous().transpose(-1, -2)):  # row and V^T memory
        got = quantized_attention(q8, qs, k8, ks, v_in, vd, used)
        assert sqnr_db(want, got) >= KERNEL_VS_REFERENCE_DB
    exact = exact_key_length_attention(q, k, v, lengths)
    assert sqnr_db(exact, got) >= SQNR_BAR_DB
