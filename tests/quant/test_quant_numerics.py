"""Reference-path numerics: fp8 / int8 round-trip error bounds and the quantized linears' outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wamrt.quant import Fp8Linear, Int8WeightOnlyLinear, quantize_rowwise_fp8, quantize_rowwise_int8, sqnr_db
from wamrt.quant.fp8 import FP8_MAX, fp8_linear_reference, fp8_linear_scaled_mm

# e4m3 has 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values; below the
# smallest normal (2^-6) the spacing is the subnormal step 2^-9, so the absolute error is <= 2^-10.
REL_NORMAL, ABS_SUBNORMAL = 2.0**-4, 2.0**-10


def test_fp8_rowwise_round_trip_bounds():
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes and heavy tails, as activations have.
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[::7, ::13] *= 50.0
    q, scale = quantize_rowwise_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert float(q.float().abs().max()) <= FP8_MAX
    # The row absmax lands on the e4m3 max, so nothing saturates and the top of the range is used.
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    deq = q.float() * scale
    bound = torch.maximum(REL_NORMAL * x.abs(), ABS_SUBNORMAL * scale)
    assert bool(((deq - x).abs() <= bound * (1 + 1e-6)).all())
    assert 30.0 < sqnr_db(x, deq) < 33.0  # ~31.5 dB expected for 3 mantissa bits


def test_fp8_zero_rows_stay_finite():
    x = torch.zeros(3, 32)
    x[1] = torch.linspace(-1, 1, 32)
    q, scale = quantize_rowwise_fp8(x)
    assert torch.isfinite(scale).all()
    assert torch.equal(q[0].float(), torch.zeros(32)) and torch.equal(q[2].float(), torch.zeros(32))


def test_int8_rowwise_round_trip_bound():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_rowwise_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())


def _linear(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(0.1 * torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_reference_matches_its_definition(bias):
    lin = _linear(256, 128, bias, 2)
    q = Fp8Linear.from_linear(lin, kernel="reference")
    x = torch.randn(2, 33, 256, generator=torch.Generator().manual_seed(3))
    out = q(x)
    assert out.shape == (2, 33, 128)
    xq, xs = quantize_rowwise_fp8(x.reshape(-1, 256))
    manual = (xq.float() * xs) @ q.dequantized_weight().t() + (lin.bias if bias else 0)
    torch.testing.assert_close(out.reshape(-1, 128), manual, rtol=1e-5, atol=1e-5)
    assert 26.0 < sqnr_db(lin(x), out) < 31.0  # weight and activation rounding: ~28.5 dB


def test_int8_weight_only_linear():
    lin = _linear(256, 128, True, 4)
    q = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5))
    out = q(x)
    torch.testing.assert_close(out, x @ q.dequantized_weight().t() + lin.bias, rtol=1e-5, atol=1e-5)
    assert sqnr_db(lin(x), out) > 38.0  # per-channel int8 on Gaussian weights: ~41 dB
    assert q(x.bfloat16()).dtype == torch.bfloat16


def test_fused_quantization_equals_per_part_quantization():
    """Per-channel weight scales + per-token activation scales: quantizing the fused q/k/v matrix is
    the same as quantizing each part, so fusing costs nothing and quantizes the activation once."""
    parts = [_linear(64, n, False, 10 + i) for i, n in enumerate((64, 32, 32))]
    fused = nn.Linear(64, 128, bias=False)
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]))
    qf = Fp8Linear.from_linear(fused, kernel="reference")
    qp = [Fp8Linear.from_linear(p, kernel="reference") for p in parts]
    assert torch.equal(qf.weight.view(torch.uint8), torch.cat([q.weight for q in qp]).view(torch.uint8))
    assert torch.equal(qf.weight_scale, torch.cat([q.weight_scale for q in qp]))
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(qf(x), torch.cat([q(x) for q in qp], dim=-1), rtol=1e-6, atol=1e-6)


def test_scaled_mm_call_on_cpu_matches_reference():
    """Exercises the kernel path's calling convention (operand layout, rowwise scale shapes) where this
    torch build runs `_scaled_mm` on CPU; the GPU test checks the real kernel."""
    lin = _linear(128, 96, True, 7)
    q = Fp8Linear.from_linear(lin)
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    xq, xs = quantize_rowwise_fp8(x)
    try:
        out = fp8_linear_scaled_mm(xq, xs, q.weight, q.weight_scale, q.bias, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on CPU here: {e}")
    ref = fp8_linear_reference(xq, xs, q.weight, q.weight_scale, q.bias, torch.float32)
    assert sqnr_db(ref, out) > 45.0  # identical math up to accumulation order and the bf16 output
