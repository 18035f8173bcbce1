"""A clip whose VAE decode runs out of device memory is decoded in tiles (diffusers' tiled decode), says so, and
leaves the VAE untiled for the next caller. The out-of-memory error is simulated: CPU tests have no device
memory to exhaust."""

from __future__ import annotations

import pytest
import torch
from oracle.assets import tiny_assets

from wamrt.pipeline.omni import TILED_DECODE_NOTE, decode_pixels


@pytest.fixture
def assets(tmp_path):
    a = tiny_assets(tmp_path)
    # Small tiles, so that a 64x96 clip really is cut into overlapping tiles (the defaults are 256 pixels).
    a.vae.tile_sample_min_height = a.vae.tile_sample_min_width = 32
    a.vae.tile_sample_stride_height = a.vae.tile_sample_stride_width = 16
    return a


def _out_of_memory_unless_tiled(monkeypatch, vae) -> list[bool]:
    real, tiling_per_call = vae.decode, []

    def decode(z, *args, **kwargs):
        tiling_per_call.append(vae.use_tiling)
        if not vae.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real(z, *args, **kwargs)

    monkeypatch.setattr(vae, "decode", decode)
    return tiling_per_call


def test_out_of_memory_decode_falls_back_to_tiles(assets, monkeypatch):
    latents = torch.randn(1, 48, 2, 4, 6, generator=torch.Generator().manual_seed(0))  # 5 frames of 64x96
    full = decode_pixels(assets.encoder, latents)
    calls = _out_of_memory_unless_tiled(monkeypatch, assets.vae)
    notes: list[str] = []
    tiled = decode_pixels(assets.encoder, latents, notes=notes)
    assert calls == [False, True] and notes == [TILED_DECODE_NOTE]
    assert not assets.vae.use_tiling  # restored for the next decode
    assert tiled.shape == full.shape == (5, 64, 96, 3) and torch.isfinite(tiled).all()
    assert not torch.equal(tiled, full)  # real tiles, blended at the seams: an approximation, hence the note


def test_out_of_memory_while_tiled_is_raised(assets, monkeypatch):
    assets.vae.enable_tiling()

    def decode(z, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(assets.vae, "decode", decode)
    with pytest.raises(torch.OutOfMemoryError):
        decode_pixels(assets.encoder, torch.randn(1, 48, 1, 2, 3))
