"""The first-frame VAE encode (engine/vae_encode.py) against diffusers' own encode. CPU, fp32, tiny Wan2.2-layout
VAE: its encoder has every module kind the real one has (residual down blocks with temporal and spatial
downsamplers and average shortcuts, the mid block's attention, the head). The GPU test (skipped without CUDA)
compares bf16 encodes of the full-size encoder."""

from __future__ import annotations

import logging

import pytest
import torch
from oracle.assets import tiny_assets
from torch import nn

from wamrt.engine.vae_encode import FirstFrameEncoder
from wamrt.pipeline.errors import RequestError

# max |ours - diffusers| <= REL_TOL * max |diffusers|: fp32, the same sums without the zero taps (~1e-6 seen).
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("vae-encode"))


def _pixels(b: int, t: int, h: int = 64, w: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert scale > 0 and err <= REL_TOL * scale, f"{what}: {err:.3e} > {REL_TOL} * {scale:.3e}"


def _state(vae: nn.Module) -> list[tuple[str, type, tuple[str, ...]]]:
    return [(name, type(m), tuple(sorted(m.__dict__))) for name, m in vae.named_modules()]


def test_one_frame_equals_diffusers_encode(assets) -> None:
    ours = FirstFrameEncoder(assets.encoder)
    kinds = {type(m).__name__ for m in assets.vae.encoder.modules()}
    assert {"WanResidualDownBlock", "AvgDown3D", "WanResample", "WanAttentionBlock"} <= kinds  # every rule runs
    for b in (1, 2):
        pixels = _pixels(b, 1, seed=b)
        want = assets.encoder.encode(pixels)
        before = _state(assets.vae)
        _assert_close(ours.encode(pixels), want, f"batch {b}")
        assert _state(assets.vae) == before  # the shared VAE is read, never modified


def test_uint8_frames_and_odd_sizes(assets) -> None:
    ours = FirstFrameEncoder(assets.encoder)
    frames = torch.randint(0, 256, (2, 48, 80, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    _assert_close(ours.encode_uint8(frames), assets.encoder.encode_uint8(frames), "uint8 frames 48x80")
    with pytest.raises(RequestError, match="multiple of 16"):
        ours.encode(_pixels(1, 1, 40, 64))
    with pytest.raises(RequestError, match="uint8"):
        ours.encode_uint8(frames.float())


def test_several_frames_go_to_diffusers(assets) -> None:
    pixels = _pixels(1, 5)
    assert torch.equal(FirstFrameEncoder(assets.encoder).encode(pixels), assets.encoder.encode(pixels))


def test_tap_cache_follows_new_weights(assets) -> None:
    """Derived tensors (taps, folded biases) follow a reloaded parameter: the stem's weight, and the biases a residual
    block folds into its add (its second convolution's and its shortcut convolution's)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    ours = FirstFrameEncoder(assets.encoder, fold_biases=True)
    pixels = _pixels(1, 1, seed=5)
    ours.encode(pixels)
    block = next(m for m in assets.vae.encoder.modules()
                 if isinstance(m, WanResidualBlock) and not isinstance(m.conv_shortcut, nn.Identity))
    for module, name in ((assets.vae.encoder.conv_in, "weight"), (block.conv2, "bias"), (block.conv_shortcut, "bias")):
        saved = getattr(module, name)
        try:
            setattr(module, name, nn.Parameter(saved.detach() * 2 + 0.1, requires_grad=False))  # weights reloaded
            _assert_close(ours.encode(pixels), assets.encoder.encode(pixels), f"after a swap of {name}")
        finally:
            setattr(module, name, saved)


def test_unknown_module_falls_back_to_diffusers(assets, caplog) -> None:
    ours = FirstFrameEncoder(assets.encoder)
    enc = assets.vae.encoder
    saved = enc.nonlinearity
    enc.nonlinearity = nn.GELU()  # no fused rule for it: the whole encode must be diffusers' own
    try:
        pixels = _pixels(1, 1, seed=7)
        with caplog.at_level(logging.WARNING, logger="wamrt.engine.vae_encode"):
            got = ours.encode(pixels)
        assert torch.equal(got, assets.encoder.encode(pixels))
        assert "GELU" in caplog.text and "diffusers" in caplog.text
    finally:
        enc.nonlinearity = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_size_bf16_encode_matches_diffusers() -> None:
    from wamrt.pipeline.random_weights import random_vae
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    frames = FrameEncoder(random_vae(dev, torch.bfloat16))
    ours = FirstFrameEncoder(frames)
    ref32 = FrameEncoder(random_vae(dev, torch.float32))
    pixels = _pixels(1, 1, 480, 640, seed=9).to(dev)
    want = ref32.encode(pixels)
    diffusers_err = (frames.encode(pixels) - want).abs().max().item()
    ours_err = (ours.encode(pixels) - want).abs().max().item()
    # bf16 against the fp32 encode: ours rounds fewer times than diffusers' bf16 path, so no further away (with
    # slack for cuDNN's algorithm choice).
    assert ours_err <= 1.5 * diffusers_err, (ours_err, diffusers_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_encode_replays_the_eager_walk_exactly() -> None:
    from wamrt.pipeline.random_weights import random_vae
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    frames = FrameEncoder(random_vae(dev, torch.bfloat16))
    eager, graphed = FirstFrameEncoder(frames), FirstFrameEncoder(frames, capture=True, max_graphs=1)
    for b, seed in ((1, 11), (1, 12), (2, 13), (1, 14)):  # new shapes evict the old graph (max_graphs=1)
        pixels = _pixels(b, 1, 480, 640, seed=seed).to(dev)
        assert torch.equal(graphed.encode(pixels), eager.encode(pixels)), (b, seed)
    assert graphed.capture and len(graphed._graphs) == 1


def test_graph_rows_bound_the_captured_batch_sizes() -> None:
    """Exact batch sizes up to 8, powers of two above: batches of 1 to 128 (a grid's policy calls) need at most the
    default 12 graphs, and no batch is padded to more than twice its frames."""
    from wamrt.engine.vae_encode import graph_rows, pad_rows

    sizes = {graph_rows(b) for b in range(1, 129)}
    assert sizes == {1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128}
    assert len(sizes) <= FirstFrameEncoder.__init__.__kwdefaults__["max_graphs"]
    assert all(b <= graph_rows(b) < 2 * b for b in range(1, 129))
    x = torch.arange(3 * 2).reshape(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[:3], x) and torch.equal(padded[3:], x[:1].expand(2, 2))
    assert pad_rows(x, 3) is x
    # with the engine's batch ladder (a server's: its top rung is the max batch its memory plan counts)
    assert [graph_rows(b, (1, 2, 4, 8, 12)) for b in (1, 3, 5, 9, 12, 13)] == [1, 4, 8, 12, 12, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_encode_pads_large_batches_to_the_ladder() -> None:
    """Batches of 9 to 16 frames share the graph of 16: each gives the eager walk's bits on the same padded batch."""
    from wamrt.engine.vae_encode import pad_rows
    from wamrt.pipeline.random_weights import random_vae
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    frames = FrameEncoder(random_vae(dev, torch.bfloat16))
    eager, graphed = FirstFrameEncoder(frames), FirstFrameEncoder(frames, capture=True)
    for b, seed in ((11, 41), (9, 42), (16, 43)):
        pixels = _pixels(b, 1, 240, 320, seed=seed).to(dev)
        got = graphed.encode(pixels)
        assert got.shape[0] == b
        assert torch.equal(got, eager.encode(pad_rows(pixels, 16))[:b]), (b, seed)
    assert len(graphed._graphs) == 1


def test_canvas_content_equals_the_padded_canvas(assets) -> None:
    """encode_content_uint8 pads on the device what pad_to_bucket pads on the host: every pad mode gives the latent
    of the host-padded pixels (diffusers' encoder and the first-frame walk alike)."""
    from wamrt.pipeline.canvas import PaddedCanvas
    from wamrt.pipeline.geometry import CanvasGeometry

    gen = torch.Generator().manual_seed(21)
    ours = FirstFrameEncoder(assets.encoder)
    geometries = {
        "reflect": CanvasGeometry(36, 70, 48, 80, 36, 70),
        "edge": CanvasGeometry(20, 70, 48, 80, 20, 70),  # pad (28) >= content height: numpy's edge mode
        "none": CanvasGeometry(48, 80, 48, 80, 48, 80),
    }
    for mode, geo in geometries.items():
        assert geo.pad_mode == mode
        content = torch.randint(0, 256, (2, geo.content_h, geo.content_w, 3), dtype=torch.uint8, generator=gen)
        padded = torch.stack([torch.from_numpy(PaddedCanvas(c.numpy(), geo).pixels.copy()) for c in content])
        assert padded.shape[1:3] == (geo.canvas_h, geo.canvas_w)
        want = assets.encoder.encode_uint8(padded)
        _assert_close(assets.encoder.encode_content_uint8(content, geo), want, f"diffusers, {mode} pad")
        _assert_close(ours.encode_content_uint8(content, geo), want, f"first-frame walk, {mode} pad")
    with pytest.raises(RequestError, match="canvas content for its geometry"):
        assets.encoder.encode_content_uint8(content[:, :10], geometries["none"])


def test_stem_channels_padded_for_tensor_cores(assets) -> None:
    """The patchified stem (12 channels) runs on zero-padded taps; off (channel_multiple=1) it does not; the mid
    block's attention as two GEMMs equals the module's SDPA, and the residual blocks' biases folded into the norm and
    the add equal the separate bias passes: every setting gives diffusers' latent."""
    conv_in = assets.vae.encoder.conv_in
    pixels = _pixels(1, 1, seed=23)
    want = assets.encoder.encode(pixels)
    for multiple in (1, 8):
        for gemm in (False, True):
            for fold in (False, True):
                ours = FirstFrameEncoder(assets.encoder, channel_multiple=multiple, gemm_attention=gemm,
                                         fold_biases=fold)
                _assert_close(ours.encode(pixels), want,
                              f"channel_multiple={multiple}, gemm_attention={gemm}, fold_biases={fold}")
                assert ours._tap(conv_in).shape[1] == (16 if multiple == 8 else conv_in.weight.shape[1])


def test_channels_last_kernels_walk_gives_diffusers_latent(assets) -> None:
    """The walk with the per-pixel kernels (ops/channels_last.py; on CPU their references): the down blocks' pad written
    by the last residual add, the downsampler's bias added with the average shortcut, the stem's bias in its own
    pass. On and off, with and without folded biases, it gives diffusers' latent."""
    from wamrt.engine.vae_encode import _padded_downsampler

    blocks = [b for b in assets.vae.encoder.down_blocks if type(b).__name__ == "WanResidualDownBlock"]
    assert any(_padded_downsampler(b.downsampler) is not None for b in blocks)  # the fused pad runs
    assert any(b.downsampler is None for b in blocks)  # and the shortcut-only block
    for b, seed in ((1, 41), (2, 42)):
        pixels = _pixels(b, 1, seed=seed)
        want = assets.encoder.encode(pixels)
        for kernels in (False, True):
            for fold in (False, True):
                ours = FirstFrameEncoder(assets.encoder, channels_last_kernels=kernels, fold_biases=fold)
                _assert_close(ours.encode(pixels), want, f"batch {b}, kernels={kernels}, fold_biases={fold}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_canvas_content_replays_the_eager_walk_exactly() -> None:
    """The graph that starts from uint8 canvas content (conversion, reflect pad and patchify captured with the walk)
    gives the eager walk's bits on the host-padded canvas."""
    from wamrt.pipeline.canvas import PaddedCanvas
    from wamrt.pipeline.geometry import canvas_geometry
    from wamrt.pipeline.random_weights import random_vae
    from wamrt.pipeline.vae import FrameEncoder

    dev = torch.device("cuda")
    frames = FrameEncoder(random_vae(dev, torch.bfloat16))
    eager, graphed = FirstFrameEncoder(frames), FirstFrameEncoder(frames, capture=True)
    geo = canvas_geometry(540, 640, "480", "framework")
    assert geo.pad_mode == "reflect"
    for seed in (31, 32):
        content = torch.randint(0, 256, (1, 540, 640, 3), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(seed))
        padded = torch.from_numpy(PaddedCanvas(content[0].numpy(), geo).pixels.copy())[None]
        got = graphed.encode_content_uint8(content.pin_memory().to(dev, non_blocking=True), geo)
        assert torch.equal(got, eager.encode_uint8(padded.to(dev))), seed
    assert len(graphed._graphs) == 1
