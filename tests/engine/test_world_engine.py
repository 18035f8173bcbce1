"""WorldEngine (world generation on the fast path) against `run_world`, the eager reference that is itself
exact against diffusers (tests/pipeline/test_world_modes.py). CPU, fp32, tiny model with sound heads.

The engine batches both CFG branches into one Generator pass and pads prompts to buckets (zero keys); in fp32
that moves results by float rounding only. The graph path is checked with a stand-in for CUDA graphs that
re-runs each captured step on the captured buffers, so an input the replay forgets to refresh shows up.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from oracle.assets import picture, tiny_assets
from oracle.sound import tiny_sound_tokenizer
from torch.utils._pytree import tree_flatten

from wamrt.engine import EngineConfig
from wamrt.engine.world import WorldEngine, _WorldLoop, leading_clean_frames, segment_ends
from wamrt.model import Cosmos3Transformer, get_config, init_random_
from wamrt.pipeline.sound import SoundDecoder
from wamrt.pipeline.world import run_world

# max |engine - reference| <= TOL * max |reference|: fp32, batched vs sequential GEMMs (measured ~1e-7).
LATENT_REL_TOL = 1e-5
PIXEL_MAX_U8_DIFF = 1  # a value on a rounding boundary may flip

HEIGHT, WIDTH, STEPS = 32, 48, 3
CASES: dict[str, dict[str, Any]] = {
    "text2image": {"num_frames": 1, "negative_prompt": "blurry"},
    "image2video": {"num_frames": 5, "image": picture(40, 70, 0), "fps": 30.0},
    "text2video_sound": {"num_frames": 5, "enable_sound": True, "fps": 16.0},
}
# Same shapes as image2video, no clean frame: a graph of its own (image2video's last layer skips frame 0).
TEXT2VIDEO = {"num_frames": 5, "fps": 24.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    assets = tiny_assets(tmp_path_factory.mktemp("world-engine"))
    cfg = get_config("tiny-qwen").replace(sound_gen=True, sound_dim=8)
    model = init_random_(Cosmos3Transformer(cfg), 21).eval().requires_grad_(False)
    return model, assets, SoundDecoder(tiny_sound_tokenizer(seed=5))


def _request(case: str, seed: int, prompt: str = "a red ball rolls across a wooden table") -> dict[str, Any]:
    return dict(prompt=prompt, height=HEIGHT, width=WIDTH, steps=STEPS, guidance=3.0, shift=10.0,
                generator=torch.Generator().manual_seed(seed), **CASES[case])


def _reference(stack, **kw):
    model, assets, sound = stack
    return run_world(model, assets.encoder, assets.tokenizer, sound_decoder=sound, **kw)


def _engine(stack, cls=WorldEngine, **flags) -> WorldEngine:
    model, assets, _ = stack
    return cls(model, assets.encoder, assets.tokenizer,
               EngineConfig(attention="auto", compile=False, cuda_graph=False, **flags))


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert scale > 0 and err <= LATENT_REL_TOL * scale, f"{what}: {err:.3e} > {LATENT_REL_TOL} * {scale:.3e}"


def count_last_layer_rows(engine: Any) -> list[int]:
    """From now on, the row count of every pass of the engine's last layer, appended to the list returned."""
    seen: list[int] = []
    post, last = engine._post, engine.model.layers[-1]

    def counting(layer, g, o):  # noqa: ANN001, ANN202 - the layer path's post hook
        if layer is last:
            seen.append(g.shape[1])
        return post(layer, g, o)

    engine._post = counting
    return seen


def _assert_same_result(got, want) -> None:
    _assert_close(got.video_latents, want.video_latents, "video latents")
    assert got.frames is not None and want.frames is not None and got.frames.shape == want.frames.shape
    assert (got.frames.int() - want.frames.int()).abs().max().item() <= PIXEL_MAX_U8_DIFF
    assert (got.sound_latents is None) == (want.sound_latents is None)
    if want.sound_latents is not None:
        _assert_close(got.sound_latents, want.sound_latents, "sound latents")
        assert got.sound is not None and got.sound.shape == want.sound.shape


@pytest.mark.parametrize("bucket", [0, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_world_engine_matches_run_world(stack, case: str, bucket: int) -> None:
    seed = list(CASES).index(case)
    want = _reference(stack, **_request(case, seed))
    engine = _engine(stack, prompt_bucket=bucket)
    got = engine.run(sound_decoder=stack[2], **_request(case, seed))
    _assert_same_result(got, want)
    assert {"reasoner_prefill", "denoise", "vae_decode", "total"} <= set(got.timings_ms)


def test_world_engine_reports_every_step_and_stops_when_asked(stack) -> None:
    engine = _engine(stack)
    seen: list[tuple[int, int]] = []
    engine.run(sound_decoder=stack[2], on_step=lambda i, n: seen.append((i, n)), **_request("image2video", 0))
    assert seen == [(i, STEPS) for i in range(STEPS)]

    class Stop(Exception):
        pass

    def stop_after_first(i: int, n: int) -> None:
        if i == 0:
            raise Stop

    with pytest.raises(Stop):
        engine.run(sound_decoder=stack[2], on_step=stop_after_first, **_request("image2video", 0))


def test_step_segments_split_the_layers_evenly() -> None:
    assert segment_ends(36, 1) == frozenset()
    assert segment_ends(36, 4) == {8, 17, 26}
    assert segment_ends(28, 3) == {8, 18}
    assert segment_ends(2, 2) == {0}


def test_world_engine_step_segments_pause_mid_step_and_change_nothing(stack) -> None:
    """Two segments per step: `on_segment` runs once inside every step (before that step's `on_step`), and the
    result is the unsegmented engine's bit for bit (the same ops in the same order)."""
    model, assets, sound = stack
    want = _engine(stack).run(sound_decoder=sound, **_request("image2video", 0))
    config = EngineConfig(attention="auto", compile=False, cuda_graph=False)
    engine = WorldEngine(model, assets.encoder, assets.tokenizer, config, step_segments=len(model.layers))
    events: list[str] = []
    got = engine.run(sound_decoder=sound, on_segment=lambda: events.append("segment"),
                     on_step=lambda i, n: events.append(f"step {i}"), **_request("image2video", 0))
    per_step = ["segment"] * (len(model.layers) - 1)
    assert events == [e for i in range(STEPS) for e in [*per_step, f"step {i}"]]
    assert torch.equal(got.video_latents, want.video_latents)
    for bad in (0, len(model.layers) + 1):
        with pytest.raises(ValueError, match="step_segments"):
            WorldEngine(model, assets.encoder, assets.tokenizer, config, step_segments=bad)


class _RerunStep:
    """Stands in for one captured step: replay re-runs the step from the state tensors it read at capture and
    writes the tensors it produced at capture in place, as a graph replay writes its output memory."""

    def __init__(self, loop: _WorldLoop, i: int, before: tuple, after: tuple) -> None:
        self.loop, self.i, self.before, self.after = loop, i, before, after

    def replay(self) -> None:
        loop = self.loop
        loop.x_v, loop.x_s, loop.hist_v, loop.hist_s = self.before
        if self.i == 0:
            loop.kinds = None  # segment 0 holds the prologue: the prefixes are written into the step buffers again
        loop.step(self.i)
        produced, _ = tree_flatten((loop.x_v, loop.x_s, loop.hist_v, loop.hist_s))
        targets, _ = tree_flatten(self.after)
        for dst, src in zip(targets, produced, strict=True):
            if dst is not None and dst is not src:
                dst.copy_(src)
        loop.x_v, loop.x_s, loop.hist_v, loop.hist_s = self.after


class RerunWorldEngine(WorldEngine):
    def _record_segments(self, new_loop, steps, between=None):
        loop = new_loop()
        for i in range(steps):
            before = (loop.x_v, loop.x_s, loop.hist_v, loop.hist_s)
            loop.step(i)
            loop.graphs.append([_RerunStep(loop, i, before, (loop.x_v, loop.x_s, loop.hist_v, loop.hist_s))])
            if between is not None:
                between()
        return loop


def test_world_graph_path_refreshes_its_inputs_on_cpu(stack) -> None:
    """Capture on one request, replay others (another image, another seed, another prompt length in the same
    bucket): each equals the reference, and one graph serves them. Text -> video at the same shapes (no clean
    frame, another fps) is a second graph, replayed by another text -> video request."""
    engine = _engine(stack, RerunWorldEngine, prompt_bucket=512)  # byte-level tokens: both prompts in one bucket
    engine.config = replace(engine.config, cuda_graph=True)  # the graph path, minus the CUDA check
    requests = [
        _request("image2video", 0),
        {**_request("image2video", 1), "image": picture(50, 60, 3)},
        _request("image2video", 2, prompt="a much longer prompt about a blue cube that slides down a ramp and stops"),
        {**_request("image2video", 3), "image": None, **TEXT2VIDEO},
        {**_request("image2video", 5), "image": None, **TEXT2VIDEO, "fps": 12.0},
    ]
    for n, kw in enumerate(requests):
        want = _reference(stack, **{**kw, "generator": torch.Generator().manual_seed(kw["generator"].initial_seed())})
        _assert_same_result(engine.run(sound_decoder=stack[2], **kw), want)
        assert len(engine.graphs) == (1 if n < 3 else 2), n
    want = _reference(stack, **_request("text2video_sound", 4))
    _assert_same_result(engine.run(sound_decoder=stack[2], **_request("text2video_sound", 4)), want)
    assert len(engine.graphs) == 3  # sound changes the shapes: another bucket


def test_world_capture_hands_the_host_back_between_segments_on_cpu(stack) -> None:
    """A server's `on_segment` also runs while a new shape is captured (after every recorded segment), so a
    capture does not hold policy requests up for its whole length; replays of one-segment steps never call it."""
    engine = _engine(stack, RerunWorldEngine)
    engine.config = replace(engine.config, cuda_graph=True)
    calls: list[int] = []
    engine.run(sound_decoder=stack[2], on_segment=lambda: calls.append(1), **_request("image2video", 0))
    assert len(calls) == STEPS and engine.graphs.captures == 1
    engine.run(sound_decoder=stack[2], on_segment=lambda: calls.append(2), **_request("image2video", 1))
    assert len(calls) == STEPS and engine.graphs.captures == 1


DISTILLED_CASES: dict[str, dict[str, Any]] = {
    "text2video": {"num_frames": 5},  # nothing clean: no anchor
    "image2video": {"num_frames": 5, "image": picture(40, 70, 0)},  # frame 0 re-anchored after every step
}


def _distilled(case: str, seed: int, stochastic: bool = True, **over: Any) -> dict[str, Any]:
    from wamrt.sampler import DistilledSchedule

    return dict(prompt="a red ball rolls across a wooden table", height=HEIGHT, width=WIDTH,
                schedule=DistilledSchedule((1.0, 0.8333, 0.4125, 0.2), stochastic=stochastic),
                generator=torch.Generator().manual_seed(seed), **{**DISTILLED_CASES[case], **over})


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("case", list(DISTILLED_CASES))
def test_world_engine_distilled_matches_run_world_distilled(stack, case: str, stochastic: bool) -> None:
    from wamrt.pipeline.world_distilled import run_world_distilled

    model, assets, _ = stack
    want = run_world_distilled(model, assets.encoder, assets.tokenizer, **_distilled(case, 3, stochastic))
    got = _engine(stack, prompt_bucket=16).run_distilled(**_distilled(case, 3, stochastic))
    _assert_same_result(got, want)


def test_world_engine_distilled_graph_path_refreshes_noise_and_anchor_on_cpu(stack) -> None:
    """The distilled loop's per-request inputs (pre-drawn re-noising, the clean frame it re-anchors to) are
    graph inputs: replays with another seed and another image equal the reference, from one capture."""
    from wamrt.pipeline.world_distilled import run_world_distilled

    model, assets, _ = stack
    engine = _engine(stack, RerunWorldEngine, prompt_bucket=512)
    engine.config = replace(engine.config, cuda_graph=True)
    for seed, image in ((0, picture(40, 70, 0)), (1, picture(40, 70, 0)), (2, picture(50, 60, 3))):
        want = run_world_distilled(model, assets.encoder, assets.tokenizer, **_distilled("image2video", seed,
                                                                                        image=image))
        _assert_same_result(engine.run_distilled(**_distilled("image2video", seed, image=image)), want)
    assert len(engine.graphs) == 1


def test_world_engine_refuses_what_it_does_not_run(stack) -> None:
    model, assets, _ = stack
    with pytest.raises(ValueError, match="isolate_requests"):
        WorldEngine(model, assets.encoder, assets.tokenizer,
                    EngineConfig(compile=False, cuda_graph=False, isolate_requests=True))


def test_implicit_pad_decode_equals_diffusers_decode_and_restores_the_vae(stack) -> None:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from wamrt.engine.vae_decode import implicit_pad_decoder
    from wamrt.pipeline.omni import decode_pixels

    _, assets, _ = stack
    vae = assets.vae
    latents = torch.randn(1, 48, 3, 2, 3, generator=torch.Generator().manual_seed(0))  # 9 frames of 32x48
    want = decode_pixels(assets.encoder, latents)
    with implicit_pad_decoder(vae):
        swapped = [m for m in vae.decoder.modules() if isinstance(m, WanCausalConv3d)]
        assert swapped and all(type(m) is not WanCausalConv3d for m in swapped)
        got = decode_pixels(assets.encoder, latents)
    assert all(type(m) is WanCausalConv3d for m in vae.modules() if isinstance(m, WanCausalConv3d))
    _assert_close(got, want, "decoded pixels")
    assert not torch.equal(got, torch.zeros_like(got))


def test_leading_clean_frames_counts_only_a_leading_run_every_request_shares() -> None:
    def mask(*rows):
        return torch.tensor(rows, dtype=torch.bool)

    assert leading_clean_frames(mask([False, True, True])) == 1
    assert leading_clean_frames(mask([False, False, True, True])) == 2
    assert leading_clean_frames(mask([True, True, True])) == 0  # text -> video: nothing clean
    assert leading_clean_frames(mask([False, False])) == 0  # nothing noisy
    assert leading_clean_frames(mask([True, False, True])) == 0  # a clean frame after a noisy one
    assert leading_clean_frames(mask([False, True], [False, True])) == 1
    assert leading_clean_frames(mask([False, True], [True, True])) == 0  # requests differ


V2V_FRAMES = 9  # 3 latent frames: two clean by default (condition_latent_frames [0, 1]), one noisy


@pytest.mark.parametrize("case, clean", [
    ("image2video", 1),
    ("video2video", 2),
    ("video2video_gap", 0),  # conditioned on latent frame 1 only: not a leading run, every row runs
    ("text2video_sound", 0),
])
def test_world_last_layer_skips_the_conditioning_frames(stack, case: str, clean: int) -> None:
    """EngineConfig.last_layer_read_rows on world requests: after its K/V stores the last layer runs without the
    request's leading clean latent frames (their velocity is zero), at every step. Same latents and sound as the
    engine with every row, and as run_world; the last layer saw one frame's rows fewer per clean frame."""
    sound = stack[2]
    if case.startswith("video2video"):
        video = [picture(40, 70, k) for k in range(5)]
        kw = {**_request("image2video", 7), "image": None, "num_frames": V2V_FRAMES, "video": video}
        if case == "video2video_gap":
            kw["condition_latent_frames"] = [1]
    else:
        kw = _request(case, 7)
    want = _reference(stack, **kw)
    results, rows_seen = {}, {}
    for pruned in (True, False):
        engine = _engine(stack, last_layer_read_rows=pruned)
        seen = count_last_layer_rows(engine)
        generator = torch.Generator().manual_seed(kw["generator"].initial_seed())
        results[pruned] = engine.run(sound_decoder=sound, **{**kw, "generator": generator})
        rows_seen[pruned] = seen
    _assert_same_result(results[True], want)
    _assert_same_result(results[True], results[False])
    full = rows_seen[False][0]
    assert rows_seen[False] == [full] * STEPS
    frames = want.video_latents.shape[2]
    sound_rows = 0 if want.sound_latents is None else want.sound_latents.shape[-1]
    frame_rows = (full - sound_rows) // frames
    assert rows_seen[True] == [full - clean * frame_rows] * STEPS and frame_rows > 0
