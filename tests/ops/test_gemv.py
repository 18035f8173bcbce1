"""The batch-1 projection kernel (ops/gemv.py): where it declines and falls back to F.linear (CPU), the module swap,
and the Triton kernel against F.linear on the GPU, alone and compiled into a captured graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wamrt.ops.gemv import K_MULTIPLE, GemvLinear, gemv_op, gemv_problem, undo_gemv_kernel, use_gemv_kernel

GEMV_ATOL = 2e-2  # bf16 outputs of O(1) values after fp32 accumulation over K; cuBLAS rounds the same way
GEMV_RTOL = 2e-2


def test_the_kernel_says_why_it_declines() -> None:
    w = torch.zeros(8, K_MULTIPLE)  # no grad: the device is what it declines
    assert "CUDA" in gemv_problem(torch.zeros(1, K_MULTIPLE), w)


def test_gemv_linear_falls_back_to_f_linear_off_the_kernel_and_the_swap_is_idempotent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K_MULTIPLE, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 1, K_MULTIPLE)
    want, want_one = model(x), model(x[:1])
    assert use_gemv_kernel(model) == 2 and all(isinstance(m, GemvLinear) for m in (model[0], model[2]))
    assert use_gemv_kernel(model) == 0  # already swapped
    assert torch.equal(model(x), want)  # CPU: F.linear, bit for bit
    assert torch.equal(model(x[:1]), want_one)  # one row on the CPU: still F.linear


class _NotPlain(nn.Linear):
    """Stands in for a quantized layer class: not swapped."""


def test_the_kernel_declines_under_autograd() -> None:
    w = torch.zeros(8, K_MULTIPLE, requires_grad=True)
    assert "autograd" in gemv_problem(torch.zeros(1, K_MULTIPLE), w)
    with torch.no_grad():
        assert "autograd" not in gemv_problem(torch.zeros(1, K_MULTIPLE), w)


def test_swap_leaves_other_linear_classes_alone() -> None:
    model = nn.Sequential(_NotPlain(4, 4), nn.Linear(4, 4))
    assert use_gemv_kernel(model) == 1 and type(model[0]) is _NotPlain


def test_swap_by_size_and_undo() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # 4,096 and 512 weights
    assert use_gemv_kernel(model, min_numel=1000) == 1
    assert type(model[0]) is GemvLinear and type(model[1]) is nn.Linear
    assert undo_gemv_kernel(model) == 1 and all(type(m) is nn.Linear for m in model)
    assert undo_gemv_kernel(model) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 12288), (24576, 4096), (1000, 2048), (37, 1024)])
def test_kernel_equals_f_linear(n, k) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, 1, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    assert gemv_problem(x, w) is None
    out = gemv_op(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert out.shape == (1, 1, n) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=GEMV_ATOL, rtol=GEMV_RTOL), (out.float() - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_and_captured_gemv_linear_equals_its_eager_self() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4096, 2048, bias=True, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    use_gemv_kernel(lin)  # (trainable weights under autograd take F.linear: the kernel has no backward)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    eager = torch.relu(lin(x)) * 2
    compiled = torch.compile(lambda t: torch.relu(lin(t)) * 2, dynamic=False)
    for _ in range(2):  # autotune and compile outside the capture
        uncaptured = compiled(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, uncaptured)  # the replay computes what the compiled call does
    # Inductor fuses the bias, ReLU and scale into one kernel that rounds once; eager rounds after each op
    assert torch.allclose(out.float(), eager.float(), atol=GEMV_ATOL, rtol=GEMV_RTOL)
