from __future__ import annotations

import hashlib
import itertools
import json
import logging

import pytest
from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as dpipe

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.prompts import (
    DIFFUSERS_VIEWPOINT_TEMPLATES,
    DROID_CONCAT_VIEW_DESCRIPTION,
    SYSTEM_PROMPT_IMAGE,
    SYSTEM_PROMPT_VIDEO,
    diffusers_action_json_prompt,
    diffusers_system_prompt,
    droid_prompt,
    framework_json_prompt,
    framework_plain_prompt,
)

DROID_HW = (544, 736)


def test_droid_prompt_matches_fixture_bytes(droid_request) -> None:
    req, exp = droid_request.request, droid_request.expected
    caption = droid_prompt(req["prompt"], json_format=req["format_prompt_as_json"], canvas_hw=DROID_HW)
    data = caption.encode("utf-8")
    assert data == droid_request.prompt_bytes
    assert hashlib.sha256(data).hexdigest() == exp["caption_sha256"]
    assert len(caption) == exp["caption_chars"]
    # The unconditional branch: an empty prompt gets no metadata at all.
    assert droid_prompt(exp["uncond_caption"], json_format=req["format_prompt_as_json"]) == ""


def test_concat_view_constants() -> None:
    # Lengths and short hashes recorded in droid_contract.md 1.4.
    assert len(DROID_CONCAT_VIEW_DESCRIPTION) == 188
    assert hashlib.sha256(DROID_CONCAT_VIEW_DESCRIPTION.encode()).hexdigest()[:16] == "24f47f9406a1540f"
    concat = DIFFUSERS_VIEWPOINT_TEMPLATES["concat_view"]
    assert len(concat) == 73
    assert hashlib.sha256(concat.encode()).hexdigest()[:16] == "9b8d358ef977b6f3"


def test_plain_prompt_separators_and_whitespace() -> None:
    tail = " The video is 2.0 seconds long and is of 15 FPS. This video is of 544x736 resolution."
    p = framework_plain_prompt("  wipe the table.  ", canvas_hw=DROID_HW)
    assert p.startswith("  wipe the table. This video contains")  # leading space kept, no ". ."
    assert p.endswith("with the robot visible." + tail)
    q = framework_plain_prompt("wipe the table", canvas_hw=DROID_HW)
    assert q.startswith("wipe the table. This video contains")
    # Unknown viewpoint: only the viewpoint sentence is dropped.
    r = framework_plain_prompt("wipe", canvas_hw=DROID_HW, viewpoint="nope")
    assert r == "wipe." + tail
    # Without a viewpoint sentence nothing strips the caption: "wipe  " keeps its spaces before ". ".
    assert framework_plain_prompt("wipe  ", canvas_hw=DROID_HW, viewpoint=None).startswith(
        "wipe  . The video"
    )
    # Whitespace-only is not empty for the framework: the viewpoint appender turns it into ". ...".
    assert framework_plain_prompt("  ", canvas_hw=DROID_HW).startswith(". This video contains")


def test_framework_fps_is_truncated_like_the_servers_long_tensor() -> None:
    p = framework_plain_prompt("go", canvas_hw=DROID_HW, fps=15.9, viewpoint=None)
    assert "The video is 2.0 seconds long and is of 15 FPS." in p
    j = json.loads(framework_json_prompt("go", canvas_hw=DROID_HW, fps=15.9))
    assert j["fps"] == 15.0
    with pytest.raises(RequestError):
        framework_plain_prompt("go", canvas_hw=DROID_HW, fps=0.5)


def test_framework_json_fields() -> None:
    j = json.loads(framework_json_prompt(" stack the cups ", canvas_hw=(768, 512), num_frames=61, fps=30))
    assert list(j) == ["cinematography", "actions", "duration", "fps", "resolution", "aspect_ratio"]
    assert j["actions"] == [{"time": "0:00-0:02", "description": "stack the cups."}]
    assert (j["duration"], j["fps"], j["aspect_ratio"]) == ("2s", 30.0, "2,3")  # exact 2:3 table hit
    assert j["cinematography"]["framing"].endswith(DROID_CONCAT_VIEW_DESCRIPTION)
    odd = json.loads(framework_json_prompt("x", canvas_hw=(300, 100)))
    assert odd["aspect_ratio"] == "1,3"
    assert json.loads(framework_json_prompt("   ", canvas_hw=DROID_HW))["actions"][0]["description"] == "."


def test_framework_json_is_diffusers_json_plus_view_description() -> None:
    # droid_contract 1.4.4: the Edge caption = diffusers' caption with " " + description in `framing`.
    for text in ("put the banana in the bowl", "Move it!", "done."):
        ours = json.loads(droid_prompt(text, json_format=True))
        theirs = json.loads(
            dpipe.Cosmos3OmniPipeline._build_action_json_prompt(
                text, view_point="concat_view", num_frames=33, fps=15.0, height=544, width=736
            )
        )
        theirs["cinematography"]["framing"] += " " + DROID_CONCAT_VIEW_DESCRIPTION
        assert ours == theirs


def test_diffusers_constants_are_diffusers_own() -> None:
    assert DIFFUSERS_VIEWPOINT_TEMPLATES == dpipe._ACTION_VIEWPOINT_TEMPLATES
    assert SYSTEM_PROMPT_VIDEO == dpipe._SYSTEM_PROMPT_VIDEO
    assert SYSTEM_PROMPT_IMAGE == dpipe._SYSTEM_PROMPT_IMAGE
    assert diffusers_system_prompt(1) == SYSTEM_PROMPT_IMAGE
    assert diffusers_system_prompt(33) == SYSTEM_PROMPT_VIDEO


@pytest.mark.parity
def test_diffusers_json_prompt_is_bytewise_diffusers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # diffusers warns on the unknown view point
    descriptions = ["put the banana in the bowl", "Done.", "  spaces  ", "", "Why?", 'café ✓ "quoted"']
    view_points = [None, "ego_view", "third_person_view", "wrist_view", "concat_view", "bogus"]
    frames = [1, 17, 33, 61, 2000]
    fps_values = [15.0, 24, 7.5, 0.0]
    canvases = [(544, 736), (736, 544), (640, 640), (480, 832), (832, 480), (320, 192), (100, 300)]
    for desc, vp, n, fps, (h, w) in itertools.product(
        descriptions, view_points, frames, fps_values, canvases
    ):
        expected = dpipe.Cosmos3OmniPipeline._build_action_json_prompt(
            desc, view_point=vp, num_frames=n, fps=fps, height=h, width=w
        )
        got = diffusers_action_json_prompt(desc, view_point=vp, num_frames=n, fps=fps, height=h, width=w)
        assert got == expected, (desc, vp, n, fps, h, w)


def test_prompt_type_errors() -> None:
    with pytest.raises(RequestError):
        droid_prompt(None, json_format=False)  # type: ignore[arg-type]
    with pytest.raises(RequestError):
        diffusers_action_json_prompt(3, view_point=None, num_frames=33, fps=15, height=1, width=1)  # type: ignore[arg-type]
