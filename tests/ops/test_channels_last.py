"""`ops.channels_last`: the frame-0 VAE encode's per-pixel kernels and the decoder's row norm, residual add and up
blocks' shortcut. CPU: each eager reference against the module or op it replaces (diffusers' `AvgDown3D` and
`DupUp3D`, the engine's compiled norm's eager form, `F.pad`). GPU (skipped without CUDA): each Triton kernel against
its reference, in bf16 and fp32, at the Wan2.2 encoder's and decoder's channel counts and at odd ones, and inside a
CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import AvgDown3D, DupUp3D

from wamrt.engine.vae_decode import _rms_norm_silu_eager
from wamrt.ops import channels_last as cl

FP32_TOL = 1e-5  # relative to the largest output: the same fp32 math in another summation order
BF16_ULP = 2**-7  # one bf16 rounding of the output, relative to its magnitude (8 mantissa bits)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cl(*shape: int, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, device=device, generator=gen).to(dtype)
    return x.contiguous(memory_format=torch.channels_last)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    err = (got.float() - want.float()).abs()
    bound = tol * want.float().abs().clamp_min(1.0)  # bf16: within one rounding of each value (and of 1 near 0)
    assert bool((err <= bound).all()), f"{what}: worst {err.max().item():.3e}"


@pytest.mark.parametrize("factor_t,cin,cout", [(2, 8, 16), (1, 16, 32), (1, 16, 16), (2, 12, 24), (2, 8, 8)])
def test_avg_down_reference_is_diffusers_avgdown3d_on_one_frame(factor_t, cin, cout) -> None:
    src = _cl(2, cin, 8, 12, seed=cin + cout)
    want = AvgDown3D(cin, cout, factor_t=factor_t, factor_s=2)(src.unsqueeze(2)).squeeze(2)
    _close(cl.avg_down_reference(src, cout, factor_t, 2), want, FP32_TOL, "avg_down")
    x, shift = _cl(2, cout, 4, 6, seed=1), torch.randn(cout)
    _close(cl.avg_down_add(x, shift, src, factor_t, 2), x + shift.reshape(-1, 1, 1) + want, FP32_TOL, "+ add")
    with pytest.raises(ValueError, match="average shortcut"):
        cl.avg_down_add(x, shift, src[:, :, :6], factor_t, 2)


DUP_UP_CASES = [(2, 2, 16, 8), (1, 2, 16, 16), (2, 2, 8, 8), (1, 2, 8, 4), (2, 1, 6, 12)]  # ft, fs, cin, cout


@pytest.mark.parametrize("first_chunk", [False, True])
@pytest.mark.parametrize("factor_t,factor_s,cin,cout", DUP_UP_CASES)
def test_dup_up_reference_is_diffusers_dupup3d(factor_t, factor_s, cin, cout, first_chunk) -> None:
    src = torch.randn(2, cin, 3, 4, 5, generator=torch.Generator().manual_seed(cin + cout))
    want = DupUp3D(cin, cout, factor_t=factor_t, factor_s=factor_s)(src, first_chunk=first_chunk)
    got = cl.dup_up_reference(src, cout, factor_t, factor_s, first_chunk)
    assert torch.equal(got, want)  # a gather of the same values: nothing is computed
    x = torch.randn(want.shape).contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(cl.dup_up_add(x, src, factor_t, factor_s, first_chunk), x + want)  # on CPU: the reference
    with pytest.raises(ValueError, match="up block's shortcut"):
        cl.dup_up_add(x[:, :, :, 1:], src, factor_t, factor_s, first_chunk)


def test_norm_reference_is_the_compiled_norms_math() -> None:
    x, w, b, s = _cl(2, 24, 5, 7), torch.rand(24, 1, 1), torch.randn(24, 1, 1), torch.randn(24, 1, 1)
    for bias in (b, 0.0):
        for silu in (False, True):
            for shift in (None, s):
                want = _rms_norm_silu_eager(x, w, bias, silu, shift)
                got = cl.rms_norm(x, w, bias, silu, shift)  # on CPU: the reference
                _close(got, want, FP32_TOL, f"silu={silu}, shift={shift is not None}")


def test_add_reference_pads_after_the_add() -> None:
    x, s, shift = _cl(2, 6, 4, 5), _cl(2, 6, 4, 5, seed=1), torch.randn(6, 1, 1)
    want = F.pad(x + shift + s, (0, 1, 0, 1))
    got = cl.add(x, shift, s, pad=(1, 1))
    _close(got, want, FP32_TOL, "padded add")
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(cl.add(x, shift), (x + shift))


def test_problems_are_named() -> None:
    assert "CUDA" in cl.channels_last_problem(_cl(1, 4, 2, 2))
    assert "CUDA" in cl.rows_problem(torch.zeros(6, 4))
    with pytest.raises(ValueError, match="rms_norm_rows: .*CUDA"):
        cl.rms_norm_rows(torch.zeros(6, 4), torch.ones(4), 0.0, False)
    if torch.cuda.is_available():
        assert "channels-last" in cl.channels_last_problem(torch.zeros(1, 4, 2, 3, device="cuda"))
        assert "[rows, channels]" in cl.rows_problem(torch.zeros(4, 6, device="cuda").t())
        assert "[rows, channels]" in cl.rows_problem(torch.zeros(2, 4, 6, device="cuda"))
        assert "does not match" in cl.rows_problem(torch.zeros(4, 6, device="cuda"),
                                                   torch.zeros(4, 6, device="cuda", dtype=torch.bfloat16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c", [160, 320, 640, 12, 96])
def test_norm_kernel_matches_its_reference(dtype, c) -> None:
    tol = BF16_ULP if dtype is torch.bfloat16 else FP32_TOL
    x = _cl(2, c, 34, 40, device="cuda", dtype=dtype)
    w, b, s = (torch.randn(c, 1, 1, device="cuda") for _ in range(3))
    for bias in (b, 0.0):
        for silu in (False, True):
            for shift in (None, s):
                got = cl.rms_norm(x, w, bias, silu, shift)
                assert got.is_contiguous(memory_format=torch.channels_last)
                _close(got, cl.rms_norm_reference(x, w, bias, silu, shift), tol, f"c={c} silu={silu}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c", [1024, 512, 256, 384, 12])
def test_row_norm_kernel_matches_its_reference_at_the_decoders_widths(dtype, c) -> None:
    """`rms_norm_rows` on [pixels, C] memory (the decoder's channels-last 3-D activations seen flat), per-channel
    vectors in the decoder's [C, 1] shape, against the reference on the same values as a channels-last 4-D tensor."""
    tol = BF16_ULP if dtype is torch.bfloat16 else FP32_TOL
    x4 = _cl(1, c, 5, 2 * 37 + 1, device="cuda", dtype=dtype, seed=c)  # an odd pixel count: a partial last tile
    rows = x4.permute(0, 2, 3, 1).reshape(-1, c)  # the same memory, [pixels, C]
    assert rows.data_ptr() == x4.data_ptr()
    w, b, s = (torch.randn(c, 1, device="cuda") for _ in range(3))
    for bias in (b, 0.5):
        for silu in (False, True):
            for shift in (None, s):
                got = cl.rms_norm_rows(rows, w, bias, silu, shift)
                assert got.shape == rows.shape and got.is_contiguous()
                want = cl.rms_norm_reference(x4, w, bias, silu, shift).permute(0, 2, 3, 1).reshape(-1, c)
                _close(got, want, tol, f"c={c} silu={silu} shift={shift is not None}")
    # into a row range of a larger buffer (the decoder's convolution input behind its cached frames): only there
    buffer = torch.full((rows.shape[0] + 7, c), 3.0, device="cuda", dtype=dtype)
    cl.rms_norm_rows(rows, w, 0.0, True, s, out=buffer[7:])
    assert torch.equal(buffer[:7], torch.full_like(buffer[:7], 3.0))
    assert torch.equal(buffer[7:], cl.rms_norm_rows(rows, w, 0.0, True, s))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c", [1024, 256, 12])
def test_row_add_kernel_matches_its_reference(dtype, c) -> None:
    tol = BF16_ULP if dtype is torch.bfloat16 else FP32_TOL
    x4, s4 = (_cl(1, c, 5, 75, device="cuda", dtype=dtype, seed=seed) for seed in (c, c + 1))
    x, s = (t.permute(0, 2, 3, 1).reshape(-1, c) for t in (x4, s4))
    shift = torch.randn(c, 1, 1, 1, device="cuda")  # the decoder's bias shape
    for shortcut, shortcut4 in ((None, None), (s, s4)):
        got = cl.add_rows(x, shift, shortcut)
        want = cl.add_reference(x4, shift, shortcut4).permute(0, 2, 3, 1).reshape(-1, c)
        _close(got, want, tol, f"c={c} shortcut={shortcut is not None}")
    with pytest.raises(ValueError, match="does not match"):
        cl.add_rows(x, shift, s[:-1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_kernel_matches_its_reference(dtype) -> None:
    tol = BF16_ULP if dtype is torch.bfloat16 else FP32_TOL
    for c, h, w in ((160, 68, 80), (320, 34, 40), (12, 5, 7)):
        x, s = _cl(2, c, h, w, device="cuda", dtype=dtype), _cl(2, c, h, w, device="cuda", dtype=dtype, seed=1)
        shift = torch.randn(c, 1, 1, device="cuda")
        for pad in ((0, 0), (1, 1), (2, 0)):
            for shortcut in (None, s):
                got = cl.add(x, shift, shortcut, pad)
                assert got.is_contiguous(memory_format=torch.channels_last)
                _close(got, cl.add_reference(x, shift, shortcut, pad), tol, f"c={c} pad={pad}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("factor_t,factor_s,cin,cout", [(2, 2, 160, 320), (1, 2, 320, 640), (1, 2, 640, 640),
                                                        (2, 2, 12, 24), (2, 1, 16, 16)])
def test_avg_down_add_kernel_matches_its_reference(dtype, factor_t, factor_s, cin, cout) -> None:
    tol = BF16_ULP if dtype is torch.bfloat16 else FP32_TOL
    src = _cl(2, cin, 34 * factor_s, 40 * factor_s, device="cuda", dtype=dtype)
    x, shift = _cl(2, cout, 34, 40, device="cuda", dtype=dtype, seed=1), torch.randn(cout, device="cuda")
    got = cl.avg_down_add(x, shift, src, factor_t, factor_s)
    _close(got, cl.avg_down_add_reference(x, shift, src, factor_t, factor_s), tol, "avg_down_add")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "frame_major"])
@pytest.mark.parametrize("factor_t,factor_s,cin,cout", [(2, 2, 1024, 1024), (1, 2, 1024, 512), (2, 2, 24, 12),
                                                        (2, 1, 6, 12)])
def test_dup_up_add_kernel_equals_its_reference(dtype, layout, factor_t, factor_s, cin, cout) -> None:
    """Bit for bit: both are one fp32 add of the same two values, rounded once. The source and x are read in any
    layout (an upsampler's output is frame-major); the result is channels-last 3-D."""

    def laid_out(t: torch.Tensor, how: str) -> torch.Tensor:
        if how == "channels_last":
            return t.contiguous(memory_format=torch.channels_last_3d)
        if how == "frame_major":  # [b, t, c, h, w] memory
            return t.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
        return t.contiguous()

    gen = torch.Generator(device="cuda").manual_seed(cin)
    src = laid_out(torch.randn(2, cin, 2, 15, 26, device="cuda", generator=gen).to(dtype), layout)
    for x_layout in ("channels_last", "frame_major"):
        for first_chunk in (False, True):
            want_shape = cl.dup_up_reference(src, cout, factor_t, factor_s, first_chunk).shape
            x = laid_out(torch.randn(want_shape, device="cuda", generator=gen).to(dtype), x_layout)
            got = cl.dup_up_add(x, src, factor_t, factor_s, first_chunk)
            assert got.is_contiguous(memory_format=torch.channels_last_3d)
            want = cl.dup_up_add_reference(x, src, factor_t, factor_s, first_chunk)
            assert torch.equal(got, want), (x_layout, first_chunk)


@gpu
@pytest.mark.gpu
def test_kernels_replay_in_a_cuda_graph() -> None:
    x = _cl(1, 160, 68, 80, device="cuda", dtype=torch.bfloat16)
    src = _cl(1, 160, 136, 160, device="cuda", dtype=torch.bfloat16, seed=2)
    w, shift = torch.rand(160, 1, 1, device="cuda"), torch.randn(160, 1, 1, device="cuda")

    def walk(t: torch.Tensor) -> torch.Tensor:
        y = cl.add(cl.rms_norm(t, w, 0.0, True, shift), shift, t, pad=(1, 1))[:, :, :68, :80]
        return cl.avg_down_add(y.contiguous(memory_format=torch.channels_last), shift, src, 2, 2)

    want = walk(x)
    graph = torch.cuda.CUDAGraph()
    static = x.clone()
    with torch.cuda.graph(graph):
        out = walk(static)
    graph.replay()
    assert torch.equal(out, want)
