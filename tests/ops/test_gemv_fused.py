"""The one-row GEMVs with their input's work and the residual add inside (ops/gemv_fused.py): off the kernel they
are the model's ops exactly (CPU); on the GPU the Triton kernel against those ops at Nano's shapes, alone and in a
captured graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wamrt.model.norms import RMSNorm
from wamrt.ops.gemv_fused import FUSED_GEMV_ATOL, FUSED_GEMV_RTOL, gemv_add, norm_gemv, silu_gemv

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _norm(k: int, nemotron: bool, device: str = "cpu", dtype=torch.float32, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(k, 1e-6, nemotron=nemotron).to(device=device, dtype=dtype).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    norm.weight.copy_(1 + 0.3 * torch.randn(k, device=device, generator=gen))
    return norm


def test_off_the_kernel_they_are_the_models_ops() -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(2, 1, 64), torch.randn(2, 1, 48)  # two rows: never the kernel
    norm, w = _norm(64, nemotron=False), torch.randn(48, 64)
    assert torch.equal(norm_gemv(x, norm, w), F.linear(norm(x), w))
    assert torch.equal(gemv_add(x, w, residual), residual + F.linear(x, w))
    gate_up, w_down = torch.randn(2, 1, 96), torch.randn(64, 48)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_gemv(gate_up, w_down), F.linear(F.silu(gate) * up, w_down))
    assert torch.equal(silu_gemv(gate_up, w_down, residual=x), x + F.linear(F.silu(gate) * up, w_down))


def _bf16(shape, gen, scale=1.0):
    return (scale * torch.randn(shape, device="cuda", generator=gen)).to(torch.bfloat16)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.allclose(out.float(), ref, atol=FUSED_GEMV_ATOL, rtol=FUSED_GEMV_RTOL), (out.float() - ref).abs().max()


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (24576, 4096), (151936, 4096), (1000, 2048)])
@pytest.mark.parametrize("nemotron", [False, True])
@pytest.mark.parametrize("folded", [False, True])
def test_norm_gemv_kernel_equals_the_ops(n: int, k: int, nemotron: bool, folded: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x, w = _bf16((1, 1, k), gen), _bf16((n, k), gen, k ** -0.5)
    norm = _norm(k, nemotron, "cuda", torch.bfloat16, seed=k)
    if folded:  # as engine.fuse.fold_reasoner_norms leaves it: weight ones, marked, and the kernel skips it
        norm.weight.fill_(1)
        norm.folded = True
    with torch.no_grad():
        out = norm_gemv(x, norm, w)
        _assert_close(out, F.linear(norm(x).float(), w.float()))


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(4096, 12288), (1024, 3072)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_silu_gemv_and_gemv_add_kernels_equal_the_ops(n: int, k: int, with_residual: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n)
    gate_up, w, residual = _bf16((1, 1, 2 * k), gen, 2.0), _bf16((n, k), gen, k ** -0.5), _bf16((1, 1, n), gen)
    gate, up = gate_up.float().chunk(2, dim=-1)
    product = F.linear(F.silu(gate) * up, w.float())
    _assert_close(silu_gemv(gate_up, w, residual=residual if with_residual else None),
                  product + residual.float() if with_residual else product)
    x = _bf16((1, 1, k), gen)
    _assert_close(gemv_add(x, w, residual), F.linear(x.float(), w.float()) + residual.float())


@gpu
@needs_cuda
def test_captured_fused_gemvs_replay_their_eager_calls() -> None:
    torch.manual_seed(1)
    k, n = 4096, 6144
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, 1, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    norm = _norm(k, False, "cuda", torch.bfloat16)
    with torch.no_grad():
        eager = (norm_gemv(x, norm, w), gemv_add(x, w, residual))  # autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = (norm_gemv(x, norm, w), gemv_add(x, w, residual))
        for out in outs:
            out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))
