"""The VAE decode's swaps (engine/vae_decode.py) against diffusers' own modules: implicit-padding convolutions and
the fused RMS norm + SiLU. CPU, fp32, tiny Wan2.2-layout VAE (its decoder has every module kind the real one has:
residual blocks, the mid block's attention, the head); the fused norm runs eagerly there, the same math the CUDA
kernel is compiled from. The GPU tests (skipped without CUDA) check the compiled kernel's rounding and layouts
and compare bf16 decodes of the full-size decoder.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    WanCausalConv3d,
    WanDecoder3d,
    WanResidualBlock,
    WanResidualUpBlock,
    WanRMS_norm,
)
from oracle.assets import tiny_assets
from torch import nn

from wamrt.engine import vae_decode
from wamrt.engine.vae_decode import implicit_pad_decoder, rms_norm_silu
from wamrt.pipeline.omni import decode_pixels

# max |fused - diffusers| <= REL_TOL * max |diffusers|: fp32, the same math rounded in another order (~1e-6 seen).
REL_TOL = 1e-5
BF16_ULP = 2.0**-7  # bf16's spacing relative to a value (at most): one rounding of an fp32 result moves it <= half


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("vae-decode"))


def _latents() -> torch.Tensor:
    return torch.randn(1, 48, 3, 2, 3, generator=torch.Generator().manual_seed(0))  # 9 frames of 32x48


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert scale > 0 and err <= REL_TOL * scale, f"{what}: {err:.3e} > {REL_TOL} * {scale:.3e}"


def _module_state(vae: nn.Module) -> list[tuple[str, type, int | None, tuple[str, ...]]]:
    """Per module: name, class, the identity of its `nonlinearity` (if any), the names of our `_fused*` attributes."""
    return [
        (
            name,
            type(m),
            id(m._modules["nonlinearity"]) if "nonlinearity" in m._modules else None,
            tuple(sorted(k for k in m.__dict__ if k.startswith("_fused"))),
        )
        for name, m in vae.named_modules()
    ]


def _silu_parents(decoder: nn.Module) -> list[nn.Module]:
    return [m for m in decoder.modules() if isinstance(m, WanResidualBlock | WanDecoder3d)]


def _assert_diffusers_own(vae: nn.Module) -> None:
    """No class, nonlinearity or attribute of ours is left in the VAE."""
    ours = [name for name, m in vae.named_modules() if type(m).__module__.startswith("wamrt")]
    assert not ours, ours
    assert all(type(p.nonlinearity) is nn.SiLU for p in _silu_parents(vae))
    assert not [name for name, m in vae.named_modules() if any(k.startswith("_fused") for k in m.__dict__)]


@pytest.mark.parametrize("fuse_blocks", [True, False])
def test_fused_decode_equals_diffusers_decode(assets, fuse_blocks: bool) -> None:
    vae, latents = assets.vae, _latents()
    want = decode_pixels(assets.encoder, latents)
    blocks = [m for m in vae.decoder.modules() if isinstance(m, WanResidualBlock)]
    # what the fused blocks must get right: biases to fold, a shortcut convolution's among them
    assert all(b.conv1.bias.abs().max() > 0 and b.conv2.bias.abs().max() > 0 for b in blocks)
    assert any(isinstance(b.conv_shortcut, WanCausalConv3d) for b in blocks)
    with implicit_pad_decoder(vae, fuse_blocks=fuse_blocks):
        want_type = vae_decode._FusedResidualBlock if fuse_blocks else WanResidualBlock
        assert blocks and all(type(b) is want_type for b in blocks)
        up_blocks = [m for m in vae.decoder.modules() if isinstance(m, WanResidualUpBlock)]
        want_type = vae_decode._FusedResidualUpBlock if fuse_blocks else WanResidualUpBlock
        assert any(b.avg_shortcut is not None for b in up_blocks)
        assert up_blocks and all(type(b) is want_type for b in up_blocks)
        norms = [m for m in vae.decoder.modules() if isinstance(m, WanRMS_norm)]
        assert norms and all(type(m) is vae_decode._FusedRMSNorm for m in norms)
        parents = _silu_parents(vae.decoder)
        assert parents and all(type(p.nonlinearity) is nn.Identity for p in parents)
        # Every SiLU moved into exactly the norms before it; the attention block's norm has none to take.
        assert sum(m._fused_silu for m in norms) == sum(2 if isinstance(p, WanResidualBlock) else 1 for p in parents)
        assert not vae.decoder.mid_block.attentions[0].norm._fused_silu
        got = decode_pixels(assets.encoder, latents)
    _assert_close(got, want, "decoded pixels")
    assert not torch.equal(got, torch.zeros_like(got))


def test_swap_restores_the_vae_after_the_block_and_when_it_raises(assets) -> None:
    vae = assets.vae
    _assert_diffusers_own(vae)
    before = _module_state(vae)
    encoder_before = [(n, type(m)) for n, m in vae.encoder.named_modules()]
    with implicit_pad_decoder(vae):
        assert _module_state(vae) != before
        assert [(n, type(m)) for n, m in vae.encoder.named_modules()] == encoder_before  # the encoder is never touched
    assert _module_state(vae) == before
    with pytest.raises(RuntimeError, match="inside the decode"), implicit_pad_decoder(vae):
        assert _module_state(vae) != before
        raise RuntimeError("inside the decode")
    assert _module_state(vae) == before
    _assert_diffusers_own(vae)
    assert not vae_decode._swap_lock.locked()


def test_fuse_norms_false_swaps_the_convolutions_only(assets) -> None:
    vae = assets.vae
    before = _module_state(vae)
    with implicit_pad_decoder(vae, fuse_norms=False):
        assert all(
            type(m) is vae_decode._ImplicitPadCausalConv3d
            for m in vae.decoder.modules()
            if isinstance(m, WanCausalConv3d)
        )
        norms = [m for m in vae.decoder.modules() if isinstance(m, WanRMS_norm)]
        assert norms and all(type(m) is WanRMS_norm for m in norms)
        assert all(type(p.nonlinearity) is nn.SiLU for p in _silu_parents(vae.decoder))
    assert _module_state(vae) == before


def _diffusers_norm(channels: int, images: bool, seed: int) -> WanRMS_norm:
    norm = WanRMS_norm(channels, images=images)
    with torch.no_grad():
        norm.gamma.copy_(1.0 + 0.3 * torch.randn(norm.gamma.shape, generator=torch.Generator().manual_seed(seed)))
    return norm


def _input(layout: str) -> torch.Tensor:
    """[1, 16, 3, 5, 7] activations (4-D [3, 16, 5, 7] for the attention block's norm) in the decoder's layouts."""
    x = torch.randn(1, 16, 3, 5, 7, generator=torch.Generator().manual_seed(1))
    if layout == "channels_last":  # what the channels-last convolutions return on the GPU
        return x.to(memory_format=torch.channels_last_3d)
    if layout == "frame_major":  # the upsampler's [b, t, c, h, w] output seen as [b, c, t, h, w]
        return x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    if layout == "with_gaps":  # a slice: no dense view exists
        return torch.randn(1, 16, 6, 5, 7, generator=torch.Generator().manual_seed(1))[:, :, ::2]
    if layout == "images_channels_last":
        return x[0].transpose(0, 1).contiguous().to(memory_format=torch.channels_last)
    return x


LAYOUTS = ["contiguous", "channels_last", "frame_major", "with_gaps", "images_channels_last"]


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_norm_equals_diffusers_norm_and_keeps_the_memory_format(layout: str, silu: bool) -> None:
    x = _input(layout)
    norm = _diffusers_norm(16, images=x.dim() == 4, seed=2)
    want = norm(x)
    if silu:
        want = F.silu(want)
    weight = norm.gamma.detach() * norm.scale
    seen: list[torch.Tensor] = []

    def spy(rows, *args):
        seen.append(rows)
        return vae_decode._rms_norm_silu_eager(rows, *args)

    for how, got in (
        ("eager", rms_norm_silu(x, weight, norm.bias, silu)),
        ("[outer, C, inner] view", vae_decode._on_dense_rows(spy, x, weight, norm.bias, silu)),
    ):
        _assert_close(got, want, f"{how}, {layout}")
        if layout != "with_gaps":
            assert got.stride() == x.stride(), f"{how}, {layout}: strides {got.stride()} != input's {x.stride()}"
    if layout == "with_gaps":
        assert seen[0] is x  # passed on as it is
    else:  # the compiled kernel sees a contiguous 3-D view of x's own memory, not a copy
        assert seen[0].dim() == 3 and seen[0].is_contiguous() and seen[0].data_ptr() == x.data_ptr()
    assert torch.equal(want, norm(x) if not silu else F.silu(norm(x)))  # diffusers' module itself was not changed


def test_fused_norm_rounds_to_bf16_once() -> None:
    """In bf16 the fused norm is the fp32 computation rounded once (diffusers' rounds after every step)."""
    x = _input("channels_last").to(torch.bfloat16)
    norm = _diffusers_norm(16, images=False, seed=5)
    once = F.silu(norm(x.float())).to(torch.bfloat16).float()
    got = rms_norm_silu(x, norm.gamma.detach() * norm.scale, 0.0, True)
    assert got.dtype == torch.bfloat16 and torch.all((got.float() - once).abs() <= BF16_ULP * once.abs())
    stepwise = F.silu(norm.to(torch.bfloat16)(x)).float()
    assert torch.any((stepwise - once).abs() > BF16_ULP * once.abs())  # so the check above can tell the two apart


def _compile_on_cpu_raising(monkeypatch, error: BaseException) -> None:
    """`rms_norm_silu` takes its compiled branch on the CPU, where a stand-in for torch.compile returns a function
    that raises `error` when called (as a compiled function raises on its first call)."""

    def compile_(fn, **_):
        def call(*args):
            raise error

        return call

    monkeypatch.setattr(vae_decode, "COMPILED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(vae_decode, "_compiled_rms_norm_silu", None)
    monkeypatch.setattr(vae_decode, "_compile_failed", False)
    monkeypatch.setattr(vae_decode, "_recompile_limit_warned", False)
    monkeypatch.setattr(torch, "compile", compile_)


def test_a_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, caplog) -> None:
    # TorchDynamoException is the base of Inductor's errors too.
    _compile_on_cpu_raising(monkeypatch, torch._dynamo.exc.TorchDynamoException("no compiler here"))
    x, norm = _input("channels_last"), _diffusers_norm(16, images=False, seed=3)
    weight = norm.gamma.detach() * norm.scale
    with caplog.at_level(logging.WARNING, logger=vae_decode.__name__):
        for _ in range(2):
            _assert_close(rms_norm_silu(x, weight, 0.0, True), F.silu(norm(x)), "eager fallback")
    assert vae_decode._compile_failed
    assert len([r for r in caplog.records if "fused RMS norm" in r.getMessage()]) == 1


@pytest.mark.skipif(not hasattr(torch._dynamo.exc, "FailOnRecompileLimitHit"), reason="older torch")
def test_past_the_recompile_limit_new_inputs_run_eagerly_and_compiling_stays_on(monkeypatch, caplog) -> None:
    _compile_on_cpu_raising(monkeypatch, torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure, fullgraph=True"))
    x, norm = _input("frame_major"), _diffusers_norm(16, images=False, seed=3)
    weight = norm.gamma.detach() * norm.scale
    with caplog.at_level(logging.WARNING, logger=vae_decode.__name__):
        for _ in range(2):
            _assert_close(rms_norm_silu(x, weight, 0.0, False), norm(x), "eager past the limit")
    assert not vae_decode._compile_failed  # the kinds of input compiled before the limit keep their kernels
    assert len([r for r in caplog.records if "recompile limit" in r.getMessage()]) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_norm_kernel_rows_takes_pixel_major_memory_and_compile_takes_the_rest(monkeypatch, layout: str) -> None:
    """Which kernel each layout reaches, on the CPU with stand-ins: the Triton row kernel is said to be available
    and recorded; torch.compile returns the eager math, recorded. "rows" sends [pixels, C] memory (channels-last,
    and the attention block's 4-D channels-last) to the row kernel, as one contiguous 2-D view of x's own memory;
    every other layout, and every layout under "compile", to the compiled kernel."""
    calls: list[tuple[str, torch.Tensor]] = []

    def rows_kernel(rows, *args):
        calls.append(("rows", rows))
        return vae_decode._rms_norm_silu_eager(rows.unsqueeze(-1), *(a.reshape(-1, 1) if isinstance(a, torch.Tensor)
                                                                      else a for a in args)).squeeze(-1)

    def compile_(fn, **_):
        def compiled(x, *args):
            calls.append(("compile", x))
            return fn(x, *args)

        return compiled

    monkeypatch.setattr(vae_decode, "COMPILED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(vae_decode, "_compiled_rms_norm_silu", None)
    monkeypatch.setattr(vae_decode, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(vae_decode.channels_last, "rows_problem", lambda x: None if x.dim() == 2 else "not 2-D")
    monkeypatch.setattr(vae_decode.channels_last, "rms_norm_rows", rows_kernel)
    x = _input(layout)
    norm = _diffusers_norm(16, images=x.dim() == 4, seed=7)
    weight, want = norm.gamma.detach() * norm.scale, F.silu(norm(x))
    pixel_major = layout in ("channels_last", "images_channels_last")
    for kernel in ("rows", "compile"):
        calls.clear()
        got = rms_norm_silu(x, weight, norm.bias, True, torch.zeros(16, *[1] * (x.dim() - 2)), kernel=kernel)
        _assert_close(got, want, f"{kernel}, {layout}")
        if layout != "with_gaps":
            assert got.stride() == x.stride()
        assert [k for k, _ in calls] == ["rows" if kernel == "rows" and pixel_major else "compile"]
        if calls[0][0] == "rows":
            seen = calls[0][1]
            assert seen.shape == (x.numel() // 16, 16) and seen.data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="kernel must be one of"):
        rms_norm_silu(x, weight, 0.0, True, kernel="triton")


def test_an_unknown_norm_kernel_is_refused_before_anything_is_swapped(assets) -> None:
    with pytest.raises(ValueError, match="norm_kernel must be one of"), implicit_pad_decoder(assets.vae,
                                                                                          norm_kernel="fast"):
        pass
    _assert_diffusers_own(assets.vae)


def test_an_error_that_is_not_a_compile_failure_is_raised(monkeypatch) -> None:
    _compile_on_cpu_raising(monkeypatch, torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):  # the decode's tiled retry (omni._decode_fitting) must see it
        rms_norm_silu(_input("contiguous"), torch.ones(16, 1, 1, 1), 0.0, True)
    assert not vae_decode._compile_failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["rows", "compile"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_norm_rounds_once_and_keeps_the_memory_format_on_gpu(layout: str, kernel: str) -> None:
    x = _input(layout).to("cuda", torch.bfloat16)  # .to keeps strides: channels-last stays channels-last
    norm = _diffusers_norm(16, images=x.dim() == 4, seed=6).cuda()
    weight = norm.gamma.detach() * norm.scale
    once = F.silu(norm(x.float())).to(torch.bfloat16).float()
    got = rms_norm_silu(x, weight, 0.0, True, kernel=kernel)
    assert not vae_decode._compile_failed, "the fused norm ran eagerly: its torch.compile failed (see the log)"
    assert got.dtype == torch.bfloat16 and torch.all((got.float() - once).abs() <= BF16_ULP * once.abs() + 1e-6)
    if layout != "with_gaps":
        assert got.stride() == x.stride()


# bf16 decodes that differ only in kernels already differ by rounding: the swapped decode must be no further from
# the fp32 decode than diffusers' own bf16 decode is (rel. L2), up to this factor.
NOT_WORSE_THAN_BF16 = 1.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm_kernel,fuse_blocks", [("rows", True), ("rows", False), ("compile", False)])
def test_fused_bf16_decode_is_as_close_to_fp32_as_diffusers_bf16_decode(norm_kernel: str, fuse_blocks: bool) -> None:
    from wamrt.pipeline.random_weights import random_vae
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    vae = random_vae(dev, torch.bfloat16)  # the Wan2.2 decoder's full width
    gen = torch.Generator(dev).manual_seed(4)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):  # random_vae leaves them at 1: make the norm's scale matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, device=dev, generator=gen))
    reference = FrameEncoder(random_vae(dev, torch.float32))
    reference.vae.load_state_dict({k: v.float() for k, v in vae.state_dict().items()})
    encoder = FrameEncoder(vae)
    latents = torch.randn(1, 48, 3, 16, 28, generator=torch.Generator().manual_seed(0))  # 9 frames of 256x448

    def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    want = decode_pixels(reference, latents, to_host=False)
    diffusers_bf16 = decode_pixels(encoder, latents, to_host=False)
    with implicit_pad_decoder(vae, norm_kernel=norm_kernel, fuse_blocks=fuse_blocks):
        if fuse_blocks:
            assert any(type(m) is vae_decode._FusedResidualBlock for m in vae.decoder.modules())
        fused = decode_pixels(encoder, latents, to_host=False)
    assert not vae_decode._compile_failed, "the fused norm ran eagerly: its torch.compile failed (see the log)"
    assert rel_l2(fused, want) <= NOT_WORSE_THAN_BF16 * rel_l2(diffusers_bf16, want)
