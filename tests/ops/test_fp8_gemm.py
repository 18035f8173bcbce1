"""`ops.fp8_gemm`: the e4m3 GEMM with per-token and per-channel scales as a Triton TMA kernel, against its fp32
reference (the function `quant.fp8.Fp8Linear` computes) and cuBLAS's rowwise-scaled GEMM, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from wamrt.ops.fp8_gemm import fp8_gemm, fp8_gemm_problem, fp8_gemm_reference
from wamrt.quant.fp8 import Fp8Linear, fp8_linear_reference, quantize_rowwise_fp8

BF16_RTOL = 2**-7  # one bf16 rounding of the output (8 mantissa bits)
FAST_ACCUM_SLACK = 1.5  # Triton's reduced-precision accumulation against cuBLAS's: same hardware, other sum order


def _operands(m: int, n: int, k: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=gen)
    w = torch.randn(n, k, device=device, generator=gen) * k**-0.5
    xq, xs = quantize_rowwise_fp8(x)
    wq, ws = quantize_rowwise_fp8(w)
    return xq, xs, wq, ws.squeeze(-1).contiguous()


def test_reference_is_fp8_linears_function():
    xq, xs, wq, ws = _operands(33, 48, 64, "cpu")
    want = fp8_linear_reference(xq, xs, wq, ws, None, torch.bfloat16)
    assert torch.equal(fp8_gemm_reference(xq, xs, wq, ws), want)
    assert torch.equal(fp8_gemm(xq, xs, wq, ws), want)  # off CUDA the op is the reference


def test_problems_are_named():
    assert "CUDA" in fp8_gemm_problem(128, 128, 128, torch.device("cpu"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        assert "multiples of 16" in fp8_gemm_problem(128, 120, 128, torch.device("cuda"))
        assert fp8_gemm_problem(6184, 9216, 2048, torch.device("cuda")) is None


def test_fp8_linear_triton_kernel_on_cpu_is_the_reference():
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32, bias=True)
    ref = Fp8Linear.from_linear(lin, kernel="reference")
    tri = Fp8Linear.from_linear(lin, kernel="triton")
    x = torch.randn(5, 64)
    assert torch.equal(tri(x), ref(x))
    xq, xs = quantize_rowwise_fp8(x)
    assert torch.equal(ref.matmul_quantized(xq, xs, x.dtype, kernel="triton"), ref(x))
    with pytest.raises(ValueError, match="kernel must be one of"):
        Fp8Linear(64, 32, bias=False, kernel="cutlass")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


# Edge's four Generator GEMMs at a tier-480 request (both CFG rows), Nano's up-projection, a ragged small case
@pytest.mark.parametrize("m,n,k", [(6184, 4096, 2048), (6184, 2048, 2048), (6184, 9216, 2048), (6184, 2048, 9216),
                                   (6184, 24576, 4096), (37, 272, 96)])
@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_kernel_is_as_accurate_as_cublas_fast_accumulation_and_replays(m, n, k):
    """Triton's fp8 dot on Hopper keeps partial sums in the tensor cores' reduced-precision accumulator across K (as
    cuBLAS does with use_fast_accum); cuBLAS's default promotes them to fp32. So the bar is cuBLAS's fast mode."""
    xq, xs, wq, ws = _operands(m, n, k, "cuda", seed=m + n)
    exact = (xq.float() @ wq.float().t()) * xs * ws[None, :]
    got = fp8_gemm(xq, xs, wq, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)

    def cublas(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    errors = {name: ((out.float() - exact).norm() / exact.norm()).item()
              for name, out in (("triton", got), ("cublas fast", cublas(True)), ("cublas", cublas(False)))}
    print(f"\n{m}x{n}x{k}: rel L2 vs fp32 " + ", ".join(f"{name} {e:.2e}" for name, e in errors.items()))
    assert errors["triton"] <= FAST_ACCUM_SLACK * errors["cublas fast"] + BF16_RTOL / 4
    assert errors["cublas"] <= BF16_RTOL / 4  # bf16 output rounding only (~2^-9 relative L2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(xq, xs, wq, ws)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)  # replay bit-identical to the eager call
