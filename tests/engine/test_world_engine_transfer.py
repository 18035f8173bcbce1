"""WorldEngine on video transfer against `run_world` (itself checked in tests/pipeline/test_transfer.py): one and two
controls, control guidance inside an interval, with and without prompt buckets, the last layer without the control
rows, and the graph path (the CPU stand-in of tests/engine/test_world_engine.py) replaying other controls, weights
and sources from one capture. CPU, fp32, tiny model."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from oracle.assets import picture
from test_world_engine import (  # noqa: F401
    HEIGHT,
    WIDTH,
    RerunWorldEngine,
    _assert_same_result,
    _engine,
    _reference,
    count_last_layer_rows,
    stack,
)

STEPS = 3


def _source(seed: int) -> np.ndarray:
    return np.stack([np.asarray(picture(40, 70, seed + k)) for k in range(5)])


CONTROLS: dict[str, dict[str, Any]] = {
    "edge": {"controls": {"edge": True}, "control_guidance": 1.5},
    "edge_blur": {"controls": {"edge": True, "blur": {"control_weight": 0.5}}, "control_guidance": 2.0,
                  "control_guidance_interval": [900, 1000]},
    "depth_no_cg": {"controls": {"depth": {"video": _source(9)}}, "control_guidance": 1.0},
}


def _request(case: str, seed: int, **over: Any) -> dict[str, Any]:
    kw = dict(prompt="a red ball rolls across a wooden table", num_frames=5, height=HEIGHT, width=WIDTH, steps=STEPS,
              guidance=3.0, shift=10.0, generator=torch.Generator().manual_seed(seed), control_source=_source(seed),
              **CONTROLS[case])
    if case == "depth_no_cg":
        kw["control_source"] = None
    return {**kw, **over}


@pytest.mark.parametrize("bucket", [0, 16])
@pytest.mark.parametrize("case", list(CONTROLS))
def test_world_engine_transfer_matches_run_world(stack, case: str, bucket: int) -> None:  # noqa: F811
    want = _reference(stack, **_request(case, 1))
    got = _engine(stack, prompt_bucket=bucket).run(**_request(case, 1))
    _assert_same_result(got, want)


def test_world_engine_transfer_last_layer_skips_the_control_rows(stack) -> None:  # noqa: F811
    """With last_layer_read_rows the last layer runs the target's rows only (the controls' and, for the no-control
    pass, all of its own): same result as every row, and as run_world."""
    want = _reference(stack, **_request("edge_blur", 2))
    rows, results = {}, {}
    for pruned in (True, False):
        engine = _engine(stack, last_layer_read_rows=pruned)
        seen = count_last_layer_rows(engine)
        results[pruned] = engine.run(**_request("edge_blur", 2))
        rows[pruned] = seen
    _assert_same_result(results[True], want)
    _assert_same_result(results[False], want)
    target = 2 * 2  # 2 latent frames of 1 x 2 patches
    # step 0 runs the control-guided kind: [cond; uncond] with 2 controls, then the no-control pass
    assert rows[False][:2] == [3 * target, target] and rows[True][:2] == [target, target]


def test_world_engine_transfer_graph_path_refreshes_controls_on_cpu(stack) -> None:  # noqa: F811
    """One capture serves another source video, other control weights and presets, and another seed (the controls,
    their weights and the noise are graph inputs); one control instead of two is another bucket."""
    engine = _engine(stack, RerunWorldEngine, prompt_bucket=512)
    engine.config = replace(engine.config, cuda_graph=True)
    requests = [
        _request("edge_blur", 3),
        _request("edge_blur", 4, controls={"edge": {"control_weight": 2.0}, "blur": {"preset_blur_strength": "low"}},
                 control_source=_source(20)),
    ]
    for kw in requests:
        gen = torch.Generator().manual_seed(kw["generator"].initial_seed())
        want = _reference(stack, **{**kw, "generator": gen})
        _assert_same_result(engine.run(**kw), want)
        assert len(engine.graphs) == 1
    want = _reference(stack, **_request("edge", 6))
    _assert_same_result(engine.run(**_request("edge", 6)), want)
    assert len(engine.graphs) == 2


def test_world_engine_chunks_match_run_world(stack) -> None:  # noqa: F811
    """A transfer clip in two chunks on the engine (two graph buckets: the first chunk has no clean frame, the second
    starts from the last generated one): chunk 0 equals run_world's; chunk 1 equals run_world run alone from the
    engine's own last frame of chunk 0 with seed + 1 (a uint8 frame that differs by one level on a rounding boundary
    would move chunk 1 by more than float rounding, so it is compared from the same frame)."""
    want = _reference(stack, **_request("edge", 7, num_frames=9, num_video_frames_per_chunk=5))
    got = _engine(stack, prompt_bucket=16).run(**_request("edge", 7, num_frames=9, num_video_frames_per_chunk=5))
    first, second = got.chunk_latents
    assert (first - want.chunk_latents[0]).abs().max() <= 1e-5 * first.abs().max()
    edges = [v[4:9] for v in _reference_videos()]
    alone = _reference(stack, **_request("edge", 8, num_frames=5, controls={"edge": {"video": edges[0]}},
                                         control_source=None, video=[got.frames[4].numpy()],
                                         condition_latent_frames=[0], generator=torch.Generator().manual_seed(8)))
    assert (second - alone.video_latents).abs().max() <= 1e-5 * second.abs().max()


def _reference_videos() -> list[np.ndarray]:
    from wamrt.pipeline.world import world_request

    kw = _request("edge", 7, num_frames=9)
    for key in ("steps", "guidance", "shift", "generator"):
        kw.pop(key)
    return world_request(**kw).transfer.videos(HEIGHT, WIDTH, 9)
