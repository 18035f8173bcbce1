"""Frame-0-only VAE encode == latent frame 0 of diffusers' full-clip encode (tiny VAE, fp32)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from oracle.fixtures import droid_fixture_dir, droid_requests
from PIL import Image
from safetensors.torch import load_file

from wamrt.pipeline.builtin import write_vae
from wamrt.pipeline.vae import FrameEncoder, load_vae

COND_LATENT_ATOL = 1e-5  # fixture tolerances.json "cond_latent_atol"


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    write_vae(folder, seed=5)
    return load_vae(folder, dtype=torch.float32)


def reference_encode(vae, clip: torch.Tensor) -> torch.Tensor:
    """diffusers' pipeline encode (whole clip, mode of the posterior, normalised)."""
    pipe = types.SimpleNamespace(
        vae=vae,
        _vae_latents_mean=torch.tensor(vae.config.latents_mean, dtype=vae.dtype),
        _vae_latents_inv_std=1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype),
    )
    return Cosmos3OmniPipeline._encode_video(pipe, clip)


def test_frame0_encode_equals_full_clip_frame0(vae):
    g = torch.Generator().manual_seed(0)
    clip = torch.rand(1, 3, 33, 64, 96, generator=g) * 2 - 1  # 33 different frames
    full = reference_encode(vae, clip)  # [1, 48, 9, 4, 6]
    ours = FrameEncoder(vae).encode(clip[:, :, :1])
    assert ours.shape == (1, 48, 1, 4, 6)
    assert torch.allclose(ours[:, :, 0], full[:, :, 0], rtol=0, atol=1e-6), (ours[:, :, 0] - full[:, :, 0]).abs().max()
    # Later latent frames do see later pixels (so the check above is about causality, not a constant).
    assert (full[:, :, 1] - full[:, :, 0]).abs().max() > 1e-3


def test_rejects_bad_geometry(vae):
    from wamrt.pipeline.errors import RequestError

    enc = FrameEncoder(vae)
    with pytest.raises(RequestError, match="multiple of 16"):
        enc.encode(torch.zeros(1, 3, 1, 40, 64))
    with pytest.raises(RequestError, match="uint8"):
        enc.encode_uint8(torch.zeros(1, 32, 32, 3))


@pytest.mark.parametrize("req", droid_requests(), ids=lambda r: r["id"])
def test_fixture_conditioning_latent(req):
    root = droid_fixture_dir()
    enc = FrameEncoder(load_vae(root / "vae", dtype=torch.float32))
    canvas = np.asarray(Image.open(root / req["path"] / "canvas.png").convert("RGB"))
    padded = np.pad(canvas, ((0, 4), (0, 96), (0, 0)), mode="reflect")  # 540x640 -> 544x736
    latent = enc.encode_uint8(torch.from_numpy(padded)[None])[..., :33, :40]
    expected = load_file(str(root / req["path"] / "tensors.safetensors"))["cond_latent"]
    assert latent.shape == expected.shape
    assert (latent - expected).abs().max().item() <= COND_LATENT_ATOL
