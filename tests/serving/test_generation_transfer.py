"""Video transfer and long videos over HTTP (vLLM-Omni's fields on `/v1/videos` and `/v1/videos/sync`) and from
`wamrt generate`, on the embedded `tiny-world` model, CPU: the reply equals `run_world` run in the test on the same
inputs (compared after the same H.264 encode), uploaded controls, a long video's per-chunk progress, and every bad
transfer field as a typed 400 naming it."""

from __future__ import annotations

import base64
import json
from typing import Any

import av
import httpx
import numpy as np
import pytest
import torch
from oracle.generation_jobs import poll_job
from test_generation import REENCODE_MEAN_ABS_TOL, _streams, world_server  # noqa: F401

from wamrt.pipeline.world import run_world
from wamrt.serving import ServerThread
from wamrt.serving.dynamics import decode_video
from wamrt.serving.media import encode_mp4, encode_png

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _source_mp4(frames: int = 13, h: int = 40, w: int = 56) -> bytes:
    """A moving square on a gradient: edges and blur have something to find."""
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for k in range(frames):
        img = np.stack([4 * xx, 5 * yy, 128 + 0 * xx], -1)
        img[10:26, 4 + 2 * k:20 + 2 * k] = (250, 40, 40)
        out.append(img)
    return encode_mp4(np.stack(out).astype(np.uint8), 16.0)


def _ep(**kw: Any) -> str:
    return json.dumps(kw)


FORM = {"prompt": "a red block slides across a table", "size": "48x32", "num_inference_steps": "2", "seed": "4"}


def test_sync_transfer_is_run_world_on_the_same_inputs(world_server: ServerThread) -> None:  # noqa: F811
    source = _source_mp4()
    extra = {"edge": True, "blur": {"control_weight": 0.5, "preset_blur_strength": "low"}, "control_guidance": 1.7}
    r = httpx.post(world_server.http_url + "/v1/videos/sync", data={**FORM, "extra_params": _ep(**extra)},
                   files={"input_reference": ("s.mp4", source, "video/mp4")}, headers={"accept": "application/json"},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["metadata"]
    assert meta["mode"] == "transfer" and meta["controls"] == ["edge", "blur"] and meta["control_guidance"] == 1.7
    assert (meta["guidance"], meta["shift"], meta["num_frames"]) == (3.0, 10.0, 13)  # the recipe; the source's frames
    frames, audio = _streams(base64.b64decode(body["data"][0]["b64_json"]))
    assert frames.shape == (13, 32, 48, 3) and audio is None

    policy = world_server.service.world
    want = run_world(policy.model, policy.encoder, policy.tokenizer, prompt=FORM["prompt"], num_frames=13, height=32,
                     width=48, fps=24.0, steps=2, guidance=3.0, shift=10.0, use_resolution_template=False,
                     use_duration_template=False, controls={"edge": {}, "blur": {"control_weight": 0.5,
                                                                                  "preset_blur_strength": "low"}},
                     control_source=decode_video(source, "s"), control_guidance=1.7,
                     num_video_frames_per_chunk=93, generator=torch.Generator().manual_seed(4))
    want_frames, _ = _streams(encode_mp4(want.frames.numpy(), 24.0))
    assert np.abs(want_frames.astype(int) - frames.astype(int)).mean() <= REENCODE_MEAN_ABS_TOL


def test_uploaded_controls_and_the_default_size(world_server: ServerThread) -> None:  # noqa: F811
    """Depth as an upload (control_reference + control_type, no extra_params entry needed), with an edge computed
    from the source; without a size the output takes the 720p template of the source's aspect."""
    form = {**FORM, "num_frames": "5", "extra_params": _ep(edge={"preset_edge_threshold": "low"})}
    files = [("input_reference", ("s.mp4", _source_mp4(), "video/mp4")),
             ("control_reference", ("d.mp4", _source_mp4(7), "video/mp4")), ("control_type", (None, "depth"))]
    r = httpx.post(world_server.http_url + "/v1/videos/sync", data=form, files=files,
                   headers={"accept": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["controls"] == ["edge", "depth"] and r.json()["video"]["shape"] == [5, 32, 48, 3]
    no_size = {k: v for k, v in form.items() if k != "size"}
    r = httpx.post(world_server.http_url + "/v1/videos/sync", data=no_size, files=files, timeout=60)
    assert r.status_code == 400 and r.json()["field"] == "size", r.text  # 1104x832 (4:3 at 720p): over the budget


def test_long_video_job_reports_its_chunks(world_server: ServerThread) -> None:  # noqa: F811
    url = world_server.http_url
    form = {**FORM, "num_frames": "9", "extra_params": _ep(num_video_frames_per_chunk=5)}
    rec = httpx.post(url + "/v1/videos", data=form, files={"input_reference": ("i.png", _PNG)}).json()
    done = poll_job(url, rec["id"], timeout=120)
    assert done["status"] == "completed", done
    assert done["metadata"]["chunks"] == 2 and done["metadata"]["mode"] == "image2video"
    assert done["progress_detail"] == {"chunk": 2, "chunks": 2} and done["video"]["shape"] == [9, 32, 48, 3]


_SRC = {"input_reference": ("s.mp4", _source_mp4(), "video/mp4")}
_PNG = encode_png(np.full((32, 48, 3), 90, np.uint8))
BAD: dict[str, tuple[dict[str, str], Any, str]] = {
    "hint_is_a_path": ({**FORM, "extra_params": _ep(edge="/etc/hosts")}, _SRC, "extra_params.edge"),
    "hint_unknown_option": ({**FORM, "extra_params": _ep(edge={"control_path": "x"})}, _SRC,
                            "extra_params.edge.control_path"),
    "hint_weight_negative": ({**FORM, "extra_params": _ep(edge={"control_weight": -1})}, _SRC,
                             "extra_params.edge.control_weight"),
    "edge_preset_unknown": ({**FORM, "extra_params": _ep(edge={"preset_edge_threshold": "max"})}, _SRC,
                            "extra_params.edge.preset_edge_threshold"),
    "edge_without_source": ({**FORM, "extra_params": _ep(edge=True)}, None, "extra_params.edge"),
    "depth_without_upload": ({**FORM, "extra_params": _ep(depth=True)}, _SRC, "extra_params.depth"),
    "control_type_missing": (FORM, [("control_reference", ("d.mp4", _source_mp4(5), "video/mp4"))], "control_type"),
    "control_type_unknown": ({**FORM, "control_type": "normals"},
                             [("control_reference", ("d.mp4", _source_mp4(5), "video/mp4"))], "control_type"),
    "control_upload_garbage": ({**FORM, "control_type": "seg"}, [("control_reference", ("d.mp4", b"\x00junk"))],
                               "control_reference"),
    "transfer_with_sound": ({**FORM, "generate_sound": "true", "extra_params": _ep(edge=True)}, _SRC,
                           "generate_sound"),
    "transfer_with_action": ({**FORM, "extra_params": _ep(edge=True, action_mode="forward_dynamics")}, _SRC,
                             "extra_params.action_mode"),
    "guidance_without_hint": ({**FORM, "extra_params": _ep(control_guidance=2)}, None, "extra_params.control_guidance"),
    "guidance_interval_bad": ({**FORM, "extra_params": _ep(edge=True, control_guidance_interval=[900, 100])}, _SRC,
                              "extra_params.control_guidance_interval"),
    "chunk_not_4k_plus_1": ({**FORM, "num_frames": "9", "extra_params": _ep(num_video_frames_per_chunk=6)}, None,
                            "extra_params.num_video_frames_per_chunk"),
    "conditional_frames_too_many": ({**FORM, "num_frames": "13", "extra_params": _ep(num_video_frames_per_chunk=5,
                                                                                   num_conditional_frames=5)},
                                    None, "extra_params.num_conditional_frames"),
    "chunks_with_sound": ({**FORM, "num_frames": "9", "generate_sound": "true",
                           "extra_params": _ep(num_video_frames_per_chunk=5)}, None, "generate_sound"),
    "image_as_transfer_source": ({**FORM, "extra_params": _ep(edge=True)}, {"input_reference": ("i.png", _PNG)},
                                 "input_reference"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_transfer_fields_are_typed(world_server: ServerThread, case: str) -> None:  # noqa: F811
    form, files, field = BAD[case]
    before = len(world_server.app.state.video_jobs.records)
    for path in ("/v1/videos", "/v1/videos/sync"):
        r = httpx.post(world_server.http_url + path, data=form, files=files or None, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["code"] == "invalid_request" and r.json()["field"] == field, r.json()
    assert len(world_server.app.state.video_jobs.records) == before


def test_generate_cli_transfer_writes_the_clip(tmp_path) -> None:
    from wamrt.cli import main

    src = tmp_path / "src.mp4"
    src.write_bytes(_source_mp4(9))
    out = tmp_path / "out.mp4"
    code = main(["generate", "--model", "tiny-world", "--prompt", "a red block", "--control", "edge:2",
                 "--control", "blur", "--control-video", str(src), "--size", "48x32", "--frames", "9",
                 "--steps", "1", "--chunk-frames", "5", "--out", str(out), "--device", "cpu", "--quiet", "--json"])
    assert code == 0
    with av.open(str(out)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 9
    bad = main(["generate", "--model", "tiny-world", "--prompt", "p", "--control", "depth", "--control-video",
                str(src), "--size", "48x32", "--frames", "5", "--out", str(tmp_path / "b.mp4"), "--device", "cpu"])
    assert bad == 2
