from __future__ import annotations

import itertools

import pytest
from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as dpipe
from diffusers.video_processor import VideoProcessor

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.geometry import (
    DIFFUSERS_ACTION_RESOLUTION_BINS,
    canvas_geometry,
    content_size,
    diffusers_bucket,
    framework_aspect_label,
    framework_bucket,
    latent_geometry,
)


def test_diffusers_bins_are_diffusers_own_table() -> None:
    assert DIFFUSERS_ACTION_RESOLUTION_BINS == dpipe._ACTION_RESOLUTION_BINS


@pytest.mark.parametrize("tier", ["256", "480", "704", "720"])
def test_diffusers_bucket_matches_classify_height_width_bin(tier: str) -> None:
    sizes = [16, 96, 192, 320, 528, 540, 544, 640, 736, 832, 1080, 1280, 1920]
    for h, w in itertools.product(sizes, sizes):
        expected = VideoProcessor.classify_height_width_bin(h, w, ratios=dpipe._ACTION_RESOLUTION_BINS[tier])
        got = diffusers_bucket(h, w, tier)
        assert (got.height, got.width) == expected, (h, w, tier)


def test_droid_canvas_bucket_both_tables() -> None:
    fw = framework_bucket(540, 640, "480")
    assert (fw.key, fw.height, fw.width) == ("4,3", 544, 736)
    df = diffusers_bucket(540, 640, 480)
    assert (df.height, df.width) == (544, 736)


def test_framework_480_has_the_2_3_entry_diffusers_lacks() -> None:
    # A 1080x720 (H x W) concat canvas: exact 2:3 in the framework, 736x544 in diffusers.
    fw = framework_bucket(1080, 720, "480")
    assert (fw.key, fw.height, fw.width) == ("2,3", 768, 512)
    df = diffusers_bucket(1080, 720, 480)
    assert (df.height, df.width) == (736, 544)


def test_exact_ties_keep_the_first_entry() -> None:
    # 460/529 = 20/23 lies exactly halfway between 1,1 (23/23) and 4,3's 544/736 (17/23) in float64.
    assert framework_bucket(460, 529, "480").key == "1,1"
    got = diffusers_bucket(460, 529, 480)
    expected = VideoProcessor.classify_height_width_bin(460, 529, ratios=dpipe._ACTION_RESOLUTION_BINS["480"])
    assert (got.height, got.width) == expected == (640, 640)


def test_content_size_rounds_half_up_and_never_upscales() -> None:
    assert content_size(5, 8, 100, 4) == (3, 4)  # 2.5 -> 3 (banker's rounding would give 2)
    assert content_size(100, 100, 640, 640) == (100, 100)
    assert content_size(1000, 1500, 544, 736) == (491, 736)


def test_canvas_geometry_pad_modes() -> None:
    geo = canvas_geometry(540, 640, "480", "framework")
    assert geo.image_size == (544, 736, 540, 640)
    assert (geo.pad_bottom, geo.pad_right, geo.pad_mode) == (4, 96, "reflect")
    # Pad at least as large as the content -> edge padding.
    small = canvas_geometry(32, 288, "480", "diffusers")
    assert small.pad_mode == "edge"
    exact = canvas_geometry(544, 736, "480", "framework")
    assert exact.pad_mode == "none"


def test_latent_geometry_matches_each_fixture(droid_request) -> None:
    exp = droid_request.expected
    _, _, ch, cw = exp["image_size"]
    num_frames = 33
    geo = latent_geometry(num_frames, ch, cw)
    _, _, t, lh, lw = exp["vision_latent_shape"]
    assert (geo.latent_t, geo.latent_h, geo.latent_w) == (t, lh, lw)
    for branch in ("cond", "uncond"):
        assert [[geo.latent_t, geo.patch_h, geo.patch_w]] == exp["pack"][branch]["vision_token_shapes"]
    assert geo.num_vision_tokens == len(droid_request.tensors["cond.vision_sequence_indexes"])
    assert geo.tokens_per_frame == 340  # 17 x 20: the 33-row latent is padded to 34 for 2x2 patches


def test_latent_geometry_small_and_odd() -> None:
    geo = latent_geometry(1, 8, 40)
    assert (geo.latent_t, geo.latent_h, geo.latent_w, geo.patch_h, geo.patch_w) == (1, 1, 2, 1, 1)
    assert latent_geometry(5, 16, 16).latent_t == 2


def test_framework_aspect_label() -> None:
    assert framework_aspect_label(544, 736) == "4,3"
    assert framework_aspect_label(768, 512) == "2,3"
    assert framework_aspect_label(300, 100) == "1,3"  # not in any tier: reduced W,H


@pytest.mark.parametrize(
    "call",
    [
        lambda: framework_bucket(540, 640, "999"),
        lambda: diffusers_bucket(540, 640, 1080),  # diffusers has no 1080 tier
        lambda: framework_bucket(0, 640),
        lambda: content_size(-1, 5, 10, 10),
        lambda: latent_geometry(0, 16, 16),
    ],
)
def test_bad_geometry_inputs(call) -> None:
    with pytest.raises(RequestError):
        call()
