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


def _chain(x: torch.Tensor, norm: RMSNorm, weights: list[torch.Tensor], pdl: bool) -> torch.Tensor:
    """A layer's four GEMVs in the one-row stack's order, each reading the one before it."""
    qkv_like, o_like, gate_up_like, down_like = weights
    h = norm_gemv(x, norm, qkv_like, pdl=pdl)
    u = gemv_add(h, o_like, x, pdl=pdl)
    gate_up = norm_gemv(u, norm, gate_up_like, pdl=pdl)
    return silu_gemv(gate_up, down_like, residual=u, pdl=pdl)


@gpu
@needs_cuda
@pytest.mark.parametrize("preload", [1, 2, 4])
def test_pdl_chain_in_a_graph_reads_each_kernels_finished_output(preload: int, monkeypatch) -> None:
    """Under PDL a GEMV starts while the one before it runs and must wait before it reads that one's output (after
    one, two or four weight slices: `PDL_PRELOAD_SLICES`). Two layers of the chain, captured, replayed on 20 fresh
    inputs: each replay bit for bit the same chain run eagerly with PDL, and within the kernels' tolerance of the
    chain without it."""
    from wamrt.ops import gemv_fused
    from wamrt.ops.triton_support import pdl_problem

    if pdl_problem(torch.device("cuda")):
        pytest.skip(pdl_problem(torch.device("cuda")))
    monkeypatch.setattr(gemv_fused, "PDL_PRELOAD_SLICES", preload)
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, inner = 4096, 8192
    norm = _norm(k, False, "cuda", torch.bfloat16)
    weights = [_bf16((k, k), gen, k ** -0.5), _bf16((k, k), gen, k ** -0.5), _bf16((2 * inner, k), gen, k ** -0.5),
               _bf16((k, inner), gen, inner ** -0.5)]
    x = _bf16((1, 1, k), gen)
    with torch.no_grad():
        def two_layers(v, pdl):
            return _chain(_chain(v, norm, weights, pdl), norm, weights, pdl)

        two_layers(x, True)  # autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = two_layers(x, True)
        for i in range(20):
            x.copy_(_bf16((1, 1, k), gen))
            graph.replay()
            torch.cuda.synchronize()
            eager_pdl, plain = two_layers(x, True), two_layers(x, False)
            assert torch.equal(out, eager_pdl), (i, (out.float() - eager_pdl.float()).abs().max())
            assert torch.allclose(out.float(), plain.float(), atol=4 * FUSED_GEMV_ATOL, rtol=4 * FUSED_GEMV_RTOL), \
                (i, (out.float() - plain.float()).abs().max())


def test_a_preload_depth_the_kernel_cannot_tile_is_refused_by_name(monkeypatch) -> None:
    """`PDL_PRELOAD_SLICES` sets the width of the first tile (a power of two of slices): 3 is refused before any
    launch, with the setting's name."""
    from wamrt.ops import gemv_fused

    monkeypatch.setattr(gemv_fused, "PDL_PRELOAD_SLICES", 3)
    with pytest.raises(ValueError, match="PDL_PRELOAD_SLICES: 1, 2 or 4, got 3"):
        gemv_fused._fused_gemv(torch.ones(1024), torch.ones(8, 1024), gemv_fused.INPUT_PLAIN, pdl=True)
