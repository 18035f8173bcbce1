"""Video transfer and long videos in chunks (`run_world(controls=..., num_video_frames_per_chunk=...)`), CPU, fp32,
tiny random weights (both model flavours for the model-level checks).

Oracles, computed here: the model run on the hand-packed sequence (controls as clean leading frames of one vision
block, the target's positions repeated); each control pass of a layer computed on its own; the control-guidance
formula applied to the three velocities the test computes itself; a chunk re-run on its own from the previous chunk's
last frame with seed + k.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from oracle.assets import picture, tiny_assets

from wamrt.model import Cosmos3Transformer, GeneratorTokens, get_config, init_random_, sdpa_attention
from wamrt.model.attention import ControlSegments
from wamrt.model.embeddings import patchify
from wamrt.pipeline.chunks import chunk_plan
from wamrt.pipeline.controls import SYSTEM_PROMPT_TRANSFER, control_directive, cover_crop_video, edge_map
from wamrt.pipeline.denoise import denoise
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.omni import diffusers_sampling, packed_branch
from wamrt.pipeline.world import run_world, world_request

REL_TOL = 1e-5  # max |ours - oracle| <= REL_TOL * max |oracle|, fp32 (float reassociation only)
HEIGHT, WIDTH = 32, 48
FLAVOURS = ("tiny-qwen", "tiny-edge")


def _model(flavour: str, seed: int = 3) -> Cosmos3Transformer:
    return init_random_(Cosmos3Transformer(get_config(flavour)), seed).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("transfer"))


@pytest.fixture(scope="module")
def model():
    return _model("tiny-qwen", 21)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert scale > 0 and err <= REL_TOL * scale, f"{what}: {err:.3e} > {REL_TOL} * {scale:.3e}"


def _source(frames: int = 9, seed: int = 0) -> np.ndarray:
    return np.stack([np.asarray(picture(40, 70, seed + k)) for k in range(frames)])


def _packed(cfg, ids: list[int], t: int, controls: int, fps: float = 24.0):
    from wamrt.pipeline.geometry import latent_geometry

    lat = latent_geometry(4 * (t - 1) + 1, HEIGHT, WIDTH)
    return packed_branch(cfg, ids, lat, fps, torch.device("cpu"), controls=controls)


def _tokens(cfg, t: int, n: int, seed: int, noisy: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, cfg.latent_channel, t, HEIGHT // 16, WIDTH // 16)
    target = torch.randn(shape, generator=g)
    controls = torch.randn((1, n, *shape[1:]), generator=g)
    return target, controls, torch.tensor([noisy])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_one_control_is_the_hand_packed_sequence(flavour: str) -> None:
    """N = 1: the model with `controls` equals the model run on [text | control | target] packed by hand, the control
    as clean leading latent frames of one vision block and the target's (t, h, w) positions repeated for it."""
    model = _model(flavour)
    cfg = model.config
    t, ids = 3, [5, 17, 42, 8, 99, 3]
    target, controls, noisy = _tokens(cfg, t, 1, 0, [False, True, True])  # frame 0 clean (image -> video)
    branch = _packed(cfg, ids, t, controls=1)
    step = torch.tensor([700.0])
    ours = model(branch.input_ids, branch.positions, GeneratorTokens(
        step, vision=target, vision_noisy=noisy, controls=controls, control_weights=torch.ones(1, 1)))

    vision = torch.cat([controls[:, 0], target], dim=2)  # [1, C, 2T, H, W]: the control's frames first, all clean
    by_hand = model(branch.input_ids, branch.positions, GeneratorTokens(
        step, vision=vision, vision_noisy=torch.cat([torch.zeros(1, t, dtype=torch.bool), noisy], dim=1)))
    _close(ours.vision, by_hand.vision[:, :, t:], "target velocity")
    assert torch.equal(ours.vision[:, :, 0], torch.zeros_like(ours.vision[:, :, 0]))  # the clean frame's is zero
    # positions: the control's block is the target's, token for token
    g = patchify(target, cfg.latent_patch_size).shape[1]
    gen = branch.positions[0, :, len(ids):]
    assert torch.equal(gen[:, :g], gen[:, g:])
    # the cached-prefix path (what the denoising loop runs) agrees with the interleaved forward
    rope_u, rope_g = model.rope(branch.positions).split(len(ids))
    cached = model.generator_step(GeneratorTokens(step, vision=target, vision_noisy=noisy, controls=controls,
                                                  control_weights=torch.ones(1, 1)),
                                  rope_g, model.prefill_reasoner(branch.input_ids, rope_u))
    _close(cached.vision, ours.vision, "prefill + generator step")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_controls_are_the_weighted_sum_of_single_control_passes(flavour: str) -> None:
    """N = 2, one layer: control i's rows come from pass i alone, the target's are w1 * pass 1 + w2 * pass 2, each
    pass attending [text | control i | target] -- the passes computed separately here."""
    model = _model(flavour)
    layer, cfg = model.layers[0], model.config
    g = torch.Generator().manual_seed(1)
    u, m, rest = 5, 6, 6  # text tokens, tokens per control, target tokens
    hidden = torch.randn(1, 2 * m + rest, cfg.hidden_size, generator=g)
    pos = torch.rand(1, 3, u + 2 * m + rest, generator=g) * 40
    rope_u, rope_g = model.rope(pos).split(u)
    _, und_k, und_v = layer.reasoner(torch.randn(1, u, cfg.hidden_size, generator=g), rope_u, sdpa_attention)
    weights = torch.tensor([[0.3, 0.7]])
    seg = ControlSegments(2, m, weights)
    got = layer.generator(hidden, rope_g, und_k, und_v, sdpa_attention, controls=seg)

    q, k, v = layer.generator_pre(hidden, rope_g)
    outs = []
    for i in range(2):
        rows = [*range(i * m, (i + 1) * m), *range(2 * m, 2 * m + rest)]
        keys, values = torch.cat([und_k, k[:, :, rows]], dim=2), torch.cat([und_v, v[:, :, rows]], dim=2)
        outs.append(sdpa_attention(q[:, :, rows], keys, values, causal=False))
    o = torch.cat([outs[0][:, :, :m], outs[1][:, :, :m], 0.3 * outs[0][:, :, m:] + 0.7 * outs[1][:, :, m:]], dim=2)
    _close(got, layer.generator_post(hidden, o), "layer output")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_control_of_weight_zero_leaves_the_target_alone(flavour: str) -> None:
    """The whole model: controls (c1, c2) weighted (1, 0) give the target c1 alone gives (c2 is computed, never
    seen); weighted (0.5, 0.5) they give something else."""
    model = _model(flavour)
    cfg, t, ids = model.config, 2, [9, 4, 77, 3]
    target, controls, noisy = _tokens(cfg, t, 2, 4, [True, True])
    step = torch.tensor([500.0])

    def run(ctrl: torch.Tensor, w: list[float]) -> torch.Tensor:
        branch = _packed(cfg, ids, t, controls=ctrl.shape[1])
        return model(branch.input_ids, branch.positions, GeneratorTokens(
            step, vision=target, vision_noisy=noisy, controls=ctrl, control_weights=torch.tensor([w]))).vision

    alone = run(controls[:, :1], [1.0])
    assert torch.equal(run(controls, [1.0, 0.0]), alone)
    mixed = run(controls, [0.5, 0.5])
    assert (mixed - alone).abs().max() > 1e-3 * alone.abs().max()


def _transfer_request(**over):
    kw = dict(prompt="a red ball rolls across a wooden table", num_frames=9, height=HEIGHT, width=WIDTH,
              controls={"edge": True}, control_source=_source(), control_guidance=1.5, use_system_prompt=True)
    return {**kw, **over}


def test_transfer_request_packs_controls_on_the_target_grid(model, assets) -> None:
    req = world_request(**_transfer_request(controls={"edge": True, "blur": {"control_weight": 3.0}}))
    prep = req.prepare(model.config, assets.encoder, assets.tokenizer, generator=torch.Generator().manual_seed(0))
    inp = prep.inputs
    assert inp.controls is not None and inp.controls.shape == (1, 2, *inp.vision.shape[1:])
    assert torch.allclose(inp.control_weights, torch.tensor([[0.25, 0.75]]))
    videos = req.transfer.videos(HEIGHT, WIDTH, 9)
    assert np.array_equal(videos[0], edge_map(cover_crop_video(_source(), HEIGHT, WIDTH), "medium"))
    from wamrt.pipeline.vae import unit_pixels

    want = assets.encoder.encode(unit_pixels(torch.from_numpy(videos[1])).permute(1, 0, 2, 3)[None])
    assert torch.equal(inp.controls[:, 1], want)
    # cond / uncond: [text | ctrl | ctrl | target], every control on the target's positions; no-control: [text | target]
    g = patchify(inp.vision, model.config.latent_patch_size).shape[1]
    for branch in (inp.cond, inp.uncond):
        gen = branch.positions[0, :, branch.input_ids.shape[1]:]
        assert gen.shape[1] == 3 * g and torch.equal(gen[:, :g], gen[:, 2 * g:]) and torch.equal(gen[:, g:2 * g],
                                                                                             gen[:, 2 * g:])
    assert torch.equal(inp.nocontrol.input_ids, inp.cond.input_ids)
    assert torch.equal(inp.nocontrol.positions, inp.cond.positions[:, :, :inp.cond.input_ids.shape[1] + g])
    # the prompts: the transfer system prompt, and the directive naming the hints on the conditional caption only
    cond, uncond = req.captions()
    assert cond.endswith(control_directive(["edge", "blur"])) and "Follow the" not in uncond
    assert req.system_prompt == SYSTEM_PROMPT_TRANSFER
    assert not world_request(**_transfer_request(emphasize_control=False)).captions()[0].endswith(
        control_directive(["edge"]))


def test_control_guidance_is_its_formula_on_the_three_velocities(model, assets) -> None:
    """v_c = v_nc + cg (v_cond - v_nc), v = v_unc + g (v_c - v_unc) at a guided step; CFG alone outside the control
    guidance interval. The three velocities are computed here from the prepared branches."""
    g_scale, cg = 3.0, 1.7
    opts = diffusers_sampling(3, g_scale, 10.0)
    timesteps = opts.make_schedule().timesteps.tolist()
    interval = (float(timesteps[1]), 1000.0)  # strict: the first step only
    opts = replace(opts, control_guidance=cg, control_guidance_interval=interval)
    req = world_request(**_transfer_request(control_guidance=cg, control_guidance_interval=list(interval)))
    inp = req.prepare(model.config, assets.encoder, assets.tokenizer, generator=torch.Generator().manual_seed(1)).inputs
    assert req.transfer.control_guidance_interval == interval
    out = denoise(model, inp, opts, record=True)

    def velocity(branch, x, t, controls: bool) -> torch.Tensor:
        u = branch.input_ids.shape[1]
        rope_u, rope_g = model.rope(branch.positions).split(u)
        kv = model.prefill_reasoner(branch.input_ids, rope_u)
        tok = GeneratorTokens(torch.tensor([float(t)]), vision=x, vision_noisy=inp.vision_noisy,
                              controls=inp.controls if controls else None,
                              control_weights=inp.control_weights if controls else None)
        return model.generator_step(tok, rope_g, kv).vision

    for i in (0, len(timesteps) - 1):
        x = inp.vision if i == 0 else out.trace["vision"][i - 1]
        v_cond, v_unc = velocity(inp.cond, x, timesteps[i], True), velocity(inp.uncond, x, timesteps[i], True)
        v_nc = velocity(inp.nocontrol, x, timesteps[i], False)
        v_c = v_nc + cg * (v_cond - v_nc) if i == 0 else v_cond
        _close(out.trace["vision_v"][i], v_unc + g_scale * (v_c - v_unc), f"step {i}")
    assert (v_nc - v_cond).abs().max() > 1e-4  # the controls matter


def test_transfer_runs_end_to_end_and_control_guidance_one_runs_no_third_pass(model, assets) -> None:
    calls = []
    step = model.generator_step

    def counting(tok, rope, kv, **kw):
        calls.append(tok.controls is not None)
        return step(tok, rope, kv, **kw)

    model.generator_step = counting
    try:
        out = run_world(model, assets.encoder, assets.tokenizer, steps=2, guidance=3.0,
                        generator=torch.Generator().manual_seed(0), **_transfer_request(control_guidance=1.0))
    finally:
        del model.generator_step
    assert out.frames is not None and out.frames.shape == (9, HEIGHT, WIDTH, 3)
    assert calls == [True, True] * 2  # cond and uncond (both with the controls), no third pass
    assert {"controls", "control_encode", "denoise", "vae_decode"} <= set(out.timings_ms)


@pytest.mark.parametrize("over, field", [
    ({"controls": {"depth": True}}, "controls.depth.video"),
    ({"controls": None}, "control_source"),  # a transfer option without controls
    ({"enable_sound": True}, "enable_sound"),
    ({"num_frames": 1}, "num_frames"),
    ({"control_guidance": -1}, "control_guidance"),
    ({"control_guidance_interval": [900, 100]}, "control_guidance_interval"),
    ({"control_guidance_interval": "0,1000"}, "control_guidance_interval"),
    ({"control_source": np.zeros((3, 8, 8), np.uint8)}, "control_source"),
    ({"num_video_frames_per_chunk": 8}, "num_video_frames_per_chunk"),
    ({"num_video_frames_per_chunk": 5, "num_conditional_frames": 5}, "num_conditional_frames"),
    ({"num_conditional_frames": -1}, "num_conditional_frames"),
])
def test_transfer_and_chunk_errors_name_the_field(over, field: str) -> None:
    with pytest.raises(RequestError) as err:
        world_request(**_transfer_request(**over))
    assert err.value.field == field


def test_chunk_plan_covers_the_clip() -> None:
    assert chunk_plan(93, 93, 1) is None  # one chunk
    plan = chunk_plan(189, 93, 1)
    assert plan.spans == [(0, 93), (92, 93), (184, 5)]  # 93 + 92 + 4 = 189 frames
    assert chunk_plan(121, 93, 1).spans == [(0, 93), (92, 29)]
    assert chunk_plan(30, 9, 5).spans == [(0, 9), (4, 9), (8, 9), (12, 9), (16, 9), (20, 9), (24, 9)]
    assert chunk_plan(30, 9, 5).clean_latent_frames == (0, 1)
    assert chunk_plan(30, 9, 0).clean_latent_frames == ()
    with pytest.raises(RequestError, match="sound"):
        chunk_plan(189, 93, 1, enable_sound=True)


@pytest.mark.parametrize("mode", ["transfer", "image2video"])
def test_chunks_continue_from_the_last_generated_frame(model, assets, mode: str) -> None:
    """Chunk k + 1's first latent frame is the encoding of chunk k's last generated frame, and chunk k + 1 is exactly
    the request run on its own from that frame (video -> video on latent frame 0) with seed + k + 1 and the controls'
    frames of its span."""
    seed, total, chunk = 7, 13, 9  # spans (0, 9), (8, 5)
    common = dict(prompt="a ball", num_frames=total, height=HEIGHT, width=WIDTH, steps=2, guidance=3.0)
    if mode == "transfer":
        extra = _transfer_request(num_frames=total)
        extra.pop("prompt")
    else:
        extra = {"image": picture(40, 70, 5)}
    chunks: list[tuple[int, int]] = []
    out = run_world(model, assets.encoder, assets.tokenizer, **{**common, **extra}, num_video_frames_per_chunk=chunk,
                    generator=torch.Generator().manual_seed(seed), on_chunk=lambda k, n: chunks.append((k, n)))
    assert chunks == [(0, 2), (1, 2)] and out.frames.shape == (total, HEIGHT, WIDTH, 3)
    first, second = out.chunk_latents
    assert first.shape[2] == 3 and second.shape[2] == 2
    last_frame = out.frames[chunk - 1]  # chunk 0's last frame: frame 8 of the stitched clip
    from wamrt.pipeline.vae import unit_pixels

    encoded = assets.encoder.encode(unit_pixels(last_frame[None]).permute(1, 0, 2, 3)[None])
    _close(second[:, :, 0], encoded[:, :, 0], "chunk 1's latent frame 0")

    alone_kw = {**common, **extra, "num_frames": 5, "video": [last_frame.numpy()], "condition_latent_frames": [0],
                "image": None}
    if mode == "transfer":
        videos = world_request(**_transfer_request(num_frames=total)).transfer.videos(HEIGHT, WIDTH, total)
        alone_kw.update(controls={"edge": {"video": videos[0][8:13]}}, control_source=None)
    alone = run_world(model, assets.encoder, assets.tokenizer, **alone_kw,
                      generator=torch.Generator().manual_seed(seed + 1))
    _close(second, alone.video_latents, "chunk 1 run alone")
    assert torch.equal(out.frames[chunk:], alone.frames[1:])
