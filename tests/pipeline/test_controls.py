"""Video transfer controls (`wamrt.pipeline.controls`): the OpenCV edge and blur maps against goldens written by
scripts/make_control_goldens.py (cosmos-framework's recipe re-done step by step there, in its [C, T, H, W] layout),
the resize to the output, the temporal padding, and the hint options' errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from oracle.assets import picture

from wamrt.pipeline.canvas import diffusers_cover_crop
from wamrt.pipeline.controls import (
    BLUR_PRESETS,
    EDGE_PRESETS,
    blur_map,
    control_hints,
    control_video,
    cover_crop_video,
    edge_map,
    mirror_pad,
)
from wamrt.pipeline.errors import RequestError

GOLDENS = Path(__file__).parent / "data" / "control_goldens.npz"


@pytest.fixture(scope="module")
def goldens():
    return dict(np.load(GOLDENS))


@pytest.mark.parametrize("preset", list(EDGE_PRESETS))
def test_edge_control_matches_the_golden(goldens, preset: str) -> None:
    got = edge_map(goldens["clip"], preset)
    want = goldens[f"edge_{preset}"]
    assert got.dtype == np.uint8 and got.shape == want.shape == goldens["clip"].shape
    assert np.array_equal(got, want)
    assert 0 < (got > 0).mean() < 0.5 and set(np.unique(got)) == {0, 255}  # edges found, not everywhere


@pytest.mark.parametrize("preset", list(BLUR_PRESETS))
def test_blur_control_matches_the_golden(goldens, preset: str) -> None:
    clip = goldens["clip"]
    got = blur_map(clip, preset)
    assert got.dtype == np.uint8 and got.shape == clip.shape
    if preset == "none":
        assert np.array_equal(got, clip)
    else:
        assert np.array_equal(got, goldens[f"blur_{preset}"])
        assert np.abs(got.astype(int) - clip).mean() > 5  # it did blur


def test_edge_thresholds_order_the_presets(goldens) -> None:
    counts = [(edge_map(goldens["clip"], p) > 0).sum() for p in EDGE_PRESETS]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


@pytest.mark.parametrize("src_hw, out_hw", [((40, 70), (32, 48)), ((90, 50), (48, 32)), ((30, 40), (64, 96))])
def test_cover_crop_is_the_image_to_video_resize(src_hw, out_hw) -> None:
    frames = np.stack([np.asarray(picture(*src_hw, k)) for k in range(3)])
    got = cover_crop_video(frames, *out_hw)
    for k in range(3):
        want = ((diffusers_cover_crop(picture(*src_hw, k), *out_hw)[0] + 1.0) * 127.5).round()
        assert np.array_equal(got[k], want.permute(1, 2, 0).numpy().astype(np.uint8))


def _peers_pad(index: list[int], count: int) -> list[int]:
    """cosmos-framework's / vLLM-Omni's `pad_temporal_frames` on frame indexes."""
    padded = list(index)
    while len(padded) < count:
        pad = min(len(padded) - 1, count - len(padded))
        if pad <= 0:
            padded += [padded[-1]] * (count - len(padded))
            break
        padded += padded[::-1][:pad]
    return padded[:count]


@pytest.mark.parametrize("frames, count", [(1, 5), (2, 9), (3, 10), (5, 5), (7, 3), (4, 29)])
def test_mirror_pad_is_the_peers_padding(frames: int, count: int) -> None:
    assert mirror_pad(np.arange(frames), count).tolist() == _peers_pad(list(range(frames)), count)


def test_control_video_computes_at_the_output_size_and_pads(goldens) -> None:
    src = goldens["clip"]  # 2 frames of 48 x 64
    hint = control_hints({"edge": {"preset_edge_threshold": "low"}})[0]
    got = control_video(hint, src, 32, 48, 5)
    want = edge_map(cover_crop_video(src, 32, 48), "low")
    assert got.shape == (5, 32, 48, 3)
    assert np.array_equal(got, want[[0, 1, 1, 1, 1]])  # the peers' padding of 2 frames to 5
    depth = control_hints({"depth": {"video": src}})[0]
    assert np.array_equal(control_video(depth, None, 32, 48, 2), cover_crop_video(src, 32, 48))  # given: resized only


@pytest.mark.parametrize("controls, field", [
    ({}, "controls"),
    ({"canny": True}, "controls"),
    ({"edge": "/etc/passwd"}, "controls.edge"),  # a path is not a control
    ({"edge": {"control_path": "x.mp4"}}, "controls.edge"),
    ({"edge": {"control_weight": -1}}, "controls.edge.control_weight"),
    ({"edge": {"control_weight": float("nan")}}, "controls.edge.control_weight"),
    ({"edge": {"control_weight": True}}, "controls.edge.control_weight"),
    ({"edge": {"preset_edge_threshold": "extreme"}}, "controls.edge.preset_edge_threshold"),
    ({"blur": {"preset_edge_threshold": "low"}}, "controls.blur"),
    ({"blur": {"preset_blur_strength": "max"}}, "controls.blur.preset_blur_strength"),
    ({"depth": True}, "controls.depth.video"),
    ({"seg": {"video": np.zeros((2, 4, 4), np.uint8)}}, "controls.seg.video"),
    ({"edge": {"control_weight": 0}, "blur": {"control_weight": 0}}, "controls.edge.control_weight"),
])
def test_control_hint_errors_name_the_field(controls, field: str) -> None:
    with pytest.raises(RequestError) as err:
        control_hints(controls)
    assert err.value.field == field


def test_control_hints_come_in_sequence_order() -> None:
    video = np.zeros((2, 8, 8, 3), np.uint8)
    hints = control_hints({"seg": {"video": video}, "blur": True, "edge": {"control_weight": 3}})
    assert [h.key for h in hints] == ["edge", "blur", "seg"]
    assert [h.weight for h in hints] == [3.0, 1.0, 1.0] and [h.computed for h in hints] == [True, True, False]
