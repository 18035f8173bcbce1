from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
from diffusers.video_processor import VideoProcessor
from PIL import Image

from wamrt.pipeline.canvas import (
    EXTERIOR_KEYS,
    IMAGE_KEY,
    WRIST_KEY,
    as_rgb_uint8,
    compose_droid_canvas,
    diffusers_preprocess_image,
    pad_to_bucket,
    reflect_pad,
    resize_bilinear_trunc,
    vae_input,
)
from wamrt.pipeline.errors import RequestError

# ---- framework DROID canvas vs the fixtures ---------------------------------------------------------


def test_canvas_matches_fixture(droid_request, assert_bitwise) -> None:
    canvas = compose_droid_canvas(droid_request.observation)
    assert_bitwise(canvas, droid_request.canvas, f"{droid_request.id} canvas")


def test_padded_canvas_and_image_size(droid_request) -> None:
    padded = pad_to_bucket(compose_droid_canvas(droid_request.observation))
    expected = droid_request.expected["image_size"]
    assert list(padded.image_size) == expected
    assert padded.image_size == tuple(droid_request.tensors["image_size"].tolist())
    ch, cw = expected[2], expected[3]
    px = padded.pixels
    assert px.shape == (expected[0], expected[1], 3) and px.dtype == np.uint8
    assert np.array_equal(px[:ch, :cw], droid_request.canvas)  # content untouched (no resize)
    # Mirror without repeating the edge: row ch+i == row ch-2-i, column cw+j == column cw-2-j.
    for i in range(expected[0] - ch):
        assert np.array_equal(px[ch + i], px[ch - 2 - i])
    for j in range(expected[1] - cw):
        assert np.array_equal(px[:, cw + j], px[:, cw - 2 - j])


@pytest.fixture(scope="module")
def tiny_vae(fixture_root):
    from diffusers import AutoencoderKLWan
    from safetensors.torch import load_file

    folder = fixture_root / "vae"
    vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(str(folder)))
    vae.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")))
    return vae.eval()


@pytest.mark.parity
def test_padded_pixels_reproduce_cond_latent(droid_request, tiny_vae) -> None:
    """The padded canvas is not stored, but its latent is: encoding our pixels must give `cond_latent`.

    A symmetric (edge-repeating) pad instead of reflect moves this latent by >0.1, so 1e-5 (the
    fixtures' recommended tolerance; framework vs diffusers VAE differ by 2.4e-7) separates them.
    """
    padded = pad_to_bucket(compose_droid_canvas(droid_request.observation))
    with torch.no_grad():
        mu = tiny_vae.encode(vae_input(padded.pixels)).latent_dist.mean  # [1, 48, 1, 34, 46]
    mean = torch.tensor(tiny_vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(tiny_vae.config.latents_std).view(1, -1, 1, 1, 1)
    ch, cw = padded.image_size[2] // 16, padded.image_size[3] // 16
    latent = ((mu - mean) / std)[..., :ch, :cw]
    expected = torch.from_numpy(droid_request.tensors["cond_latent"])
    assert latent.shape == expected.shape
    torch.testing.assert_close(latent, expected, atol=1e-5, rtol=0)


def test_bilinear_resize_truncates_with_half_pixel_centres() -> None:
    # Row [0, 3] upsampled to width 4: sample points -0.25, 0.25, 0.75, 1.25 (clamped) give
    # 0, 0.75, 2.25, 3 -> truncation 0, 0, 2, 3 (rounding would give 0, 1, 2, 3).
    img = np.zeros((1, 2, 3), np.uint8)
    img[0, 1] = 3
    out = resize_bilinear_trunc(img, (1, 4))
    assert out[0, :, 0].tolist() == [0, 0, 2, 3]


def test_three_view_layout() -> None:
    wrist = np.full((4, 6, 3), 10, np.uint8)
    ext1 = np.full((2, 3, 3), 20, np.uint8)
    ext2 = np.full((8, 12, 3), 30, np.uint8)  # resized to 2x3 (constant stays constant)
    canvas = compose_droid_canvas(
        {WRIST_KEY: wrist, EXTERIOR_KEYS[0]: ext1, EXTERIOR_KEYS[1]: ext2}, size=(6, 6)
    )
    assert canvas.shape == (6, 6, 3)
    assert (canvas[:4] == 10).all() and (canvas[4:, :3] == 20).all() and (canvas[4:, 3:] == 30).all()


def test_single_image_wins_over_views() -> None:
    img = np.full((540, 640, 3), 7, np.uint8)
    obs = {IMAGE_KEY: img, WRIST_KEY: np.zeros((2, 2, 3), np.uint8)}
    assert (compose_droid_canvas(obs) == 7).all()


def test_non_540x640_canvas_is_resized() -> None:
    img = np.random.default_rng(0).integers(0, 256, (270, 320, 3), dtype=np.uint8)
    canvas = compose_droid_canvas({IMAGE_KEY: img})
    assert canvas.shape == (540, 640, 3)
    assert np.array_equal(canvas, resize_bilinear_trunc(img, (540, 640)))


def test_non_uint8_images_are_clipped_and_truncated() -> None:
    img = np.array([[[3.7, -5.0, 300.2]]], dtype=np.float32)
    assert as_rgb_uint8(img, "x").tolist() == [[[3, 0, 255]]]
    assert as_rgb_uint8(np.array([[[400, 1, -3]]], np.int16), "x").tolist() == [[[255, 1, 0]]]


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((5, 5), np.uint8),  # rank 2
        np.zeros((1, 5, 5, 3), np.uint8),  # rank 4
        np.zeros((5, 5, 4), np.uint8),  # RGBA
        np.zeros((5, 5, 1), np.uint8),  # grey
        np.zeros((0, 5, 3), np.uint8),  # empty
        np.full((5, 5, 3), np.nan, np.float32),
        np.full((5, 5, 3), "a"),  # strings
        np.zeros((5, 5, 3), bool),
    ],
)
def test_bad_images_raise_request_error(value) -> None:
    with pytest.raises(RequestError) as info:
        compose_droid_canvas({IMAGE_KEY: value})
    assert info.value.field == IMAGE_KEY


def test_missing_views_raise_request_error() -> None:
    with pytest.raises(RequestError) as info:
        compose_droid_canvas({WRIST_KEY: np.zeros((4, 4, 3), np.uint8)})
    assert info.value.field == EXTERIOR_KEYS[0]
    with pytest.raises(RequestError):
        compose_droid_canvas({})
    bad_exterior = {
        WRIST_KEY: np.zeros((4, 4, 3), np.uint8),
        EXTERIOR_KEYS[0]: np.zeros((4, 4), np.uint8),
        EXTERIOR_KEYS[1]: np.zeros((4, 4, 3), np.uint8),
    }
    with pytest.raises(RequestError) as info:
        compose_droid_canvas(bad_exterior)
    assert info.value.field == EXTERIOR_KEYS[0]
    odd_wrist = {WRIST_KEY: np.zeros((4, 5, 3), np.uint8), **{k: np.zeros((2, 2, 3), np.uint8) for k in EXTERIOR_KEYS}}
    with pytest.raises(RequestError) as info:  # numpy's concatenate raised a bare ValueError here
        compose_droid_canvas(odd_wrist)
    assert info.value.field == WRIST_KEY and "even" in str(info.value)


# ---- diffusers generic-mode preprocessing vs diffusers itself ---------------------------------------


def _diffusers_frames(image: Image.Image, tier: int) -> tuple[torch.Tensor, list[float]]:
    # Call diffusers' own method; it only touches `self.video_processor`.
    fake_pipe = types.SimpleNamespace(
        video_processor=VideoProcessor(vae_scale_factor=16, resample="bilinear")
    )
    frames, image_size, _, _ = Cosmos3OmniPipeline._prepare_action_video_conditioning(
        fake_pipe, [image], tier, 33, "cpu", torch.float32
    )
    return frames, image_size.tolist()  # frames: [1, 3, 33, H, W]


@pytest.mark.parity
@pytest.mark.parametrize(
    "h, w, tier",
    [
        (540, 640, 480),  # DROID canvas: diffusers shrinks to 528 rows first
        (600, 900, 480),  # bicubic antialias shrink
        (700, 400, 256),
        (37, 300, 480),  # replicate padding (pad >= content)
        (300, 37, 256),
        (723, 1301, 704),
        (900, 1700, 720),
        (480, 832, 480),  # exact bucket, no pad
        (545, 643, 480),
    ],
)
def test_diffusers_preprocessing_is_bitwise_diffusers(h: int, w: int, tier: int) -> None:
    """Bit-exact: both sides run the same PIL resize and the same torch ops in the same order."""
    pixels = np.random.default_rng(h * 7919 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    frames, image_size = _diffusers_frames(image, tier)
    ours = diffusers_preprocess_image(image, tier)
    assert list(ours.geometry.image_size) == image_size
    # diffusers repeats the single image 33 times; every frame is the same, so one frame suffices.
    assert all(torch.equal(frames[:, :, 0], frames[:, :, i]) for i in range(1, 33))
    assert ours.pixels.dtype == torch.float32
    assert torch.equal(ours.pixels, frames[:, :, 0])
    # A uint8 array goes through the same PIL path.
    assert torch.equal(diffusers_preprocess_image(pixels, tier).pixels, frames[:, :, 0])


def test_diffusers_and_framework_disagree_on_droid_content() -> None:
    img = np.zeros((540, 640, 3), np.uint8)
    assert diffusers_preprocess_image(img, 480).geometry.image_size == (544, 736, 528, 640)
    assert pad_to_bucket(img).image_size == (544, 736, 540, 640)


@pytest.mark.parametrize(
    "value",
    [
        Image.new("L", (64, 64)),
        Image.new("RGBA", (64, 64)),
        np.zeros((64, 64, 3), np.float32),
        np.zeros((15, 64, 3), np.uint8),  # floors to 0 rows
        "not an image",
    ],
)
def test_diffusers_preprocess_rejects_bad_images(value) -> None:
    with pytest.raises(RequestError):
        diffusers_preprocess_image(value, 480)


@pytest.mark.parametrize("shape,bottom,right", [((540, 640, 3), 4, 96), ((5, 7, 3), 4, 6), ((3, 3, 3), 0, 2),
                                                ((4, 9, 3), 3, 0), ((1, 5, 3), 0, 3), ((6, 5), 2, 3),
                                                ((6, 5, 4), 1, 2)])
def test_reflect_pad_equals_numpy_reflect(shape, bottom, right):
    rng = np.random.default_rng(sum(shape) + bottom + right)
    for x in (rng.integers(0, 256, shape, dtype=np.uint8), rng.standard_normal(shape).astype(np.float32)):
        want = np.pad(x, ((0, bottom), (0, right)) + ((0, 0),) * (x.ndim - 2), mode="reflect")
        assert np.array_equal(reflect_pad(x, bottom, right), want)
    with pytest.raises(ValueError, match="smaller than the image"):
        reflect_pad(x, shape[0], 0)
