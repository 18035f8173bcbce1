"""Our transformer vs diffusers 0.42.1 `Cosmos3OmniTransformer` on tiny random configs (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from oracle.transformer import Request, build_reference, ours_from_reference, reference_kwargs

from wamrt.model import (
    Cosmos3Transformer,
    GeneratorTokens,
    action_positions,
    generator_offset,
    get_config,
    sound_positions,
    text_positions,
    vision_positions,
)

pytestmark = pytest.mark.parity

REL_TOL = 1e-5  # max |ours - ref| <= REL_TOL * max |ref|, per output
MODES = {
    # mode: (clean vision frames, clean action rows, action present)
    "policy": ([0], [], True),
    "forward_dynamics": ([0], "all", True),
    "inverse_dynamics": ("all", [], True),
    "video_only": ([0], [], False),
}


def make_request(cfg, mode: str, *, sound: bool, seed: int, latent_hw=(5, 7), frames=3, rows=8, text=11):
    g = torch.Generator().manual_seed(seed)
    clean_v, clean_a, has_action = MODES[mode]
    clean_v = list(range(frames)) if clean_v == "all" else clean_v
    clean_a = list(range(rows)) if clean_a == "all" else clean_a
    return Request(
        input_ids=torch.randint(0, cfg.vocab_size, (text,), generator=g),
        vision=torch.randn(1, cfg.latent_channel, frames, *latent_hw, generator=g),
        vision_clean_frames=clean_v,
        action=torch.randn(rows, cfg.action_dim, generator=g) if has_action else None,
        action_clean_rows=clean_a,
        sound=torch.randn(cfg.sound_dim, 6, generator=g) if sound else None,
        domain=int(torch.randint(0, cfg.num_embodiment_domains, (1,), generator=g)),
        timestep=float(torch.randint(1, 1000, (1,), generator=g)),
    )


def our_inputs(model: Cosmos3Transformer, req: Request):
    cfg = model.config
    u = req.input_ids.shape[0]
    _, _, t, h, w = req.vision.shape
    off = generator_offset(cfg, u)
    pos = [text_positions(u), vision_positions(cfg, t, -(-h // 2), -(-w // 2), off, req.fps)]
    noisy_v = torch.tensor([[f not in req.vision_clean_frames for f in range(t)]])
    tok = GeneratorTokens(timesteps=torch.tensor([req.timestep]), vision=req.vision, vision_noisy=noisy_v)
    if req.sound is not None:
        pos.append(sound_positions(cfg, req.sound.shape[1], off, req.sound_fps))
        tok.sound = req.sound[None]
        tok.sound_noisy = torch.ones(1, req.sound.shape[1], dtype=torch.bool)
    if req.action is not None:
        rows = req.action.shape[0]
        pos.append(action_positions(cfg, rows, off, req.fps, start_frame=1))
        tok.action = req.action[None]
        tok.action_noisy = torch.tensor([[r not in req.action_clean_rows for r in range(rows)]])
        tok.domain_ids = torch.tensor([req.domain])
    return req.input_ids[None], torch.cat(pos, dim=1)[None], tok


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * max(scale, 1e-30), f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


def flavours():
    yield "qwen", get_config("tiny-qwen")
    yield "edge", get_config("tiny-edge")


CASES = [
    (flav, mode, sound)
    for flav in ("qwen", "edge")
    for mode in MODES
    for sound in (False, True)
]


@pytest.fixture(scope="module")
def models():
    out = {}
    for i, (name, cfg) in enumerate(flavours()):
        for sound in (False, True):
            c = cfg.replace(sound_gen=True, sound_dim=8) if sound else cfg
            ref = build_reference(c, seed=100 + 2 * i + sound)
            out[name, sound] = (ref, ours_from_reference(ref, c))
    return out


@pytest.mark.parametrize("flavour,mode,sound", CASES)
def test_forward_matches_diffusers(models, flavour, mode, sound):
    ref, ours = models[flavour, sound]
    req = make_request(ours.config, mode, sound=sound, seed=hash((flavour, mode, sound)) % 10_000)
    kw = reference_kwargs(ref, req)
    ref_v, ref_s, ref_a = ref(**kw, return_dict=False)
    ids, pos, tok = our_inputs(ours, req)
    assert torch.equal(pos[0], kw["position_ids"]), "position ids differ from the pipeline's"
    out = ours(ids, pos, tok)
    assert_close(out.vision[0], ref_v[0][0], "vision velocity")
    assert ref_v[0].abs().max() > 0 or mode == "inverse_dynamics"
    if sound:
        assert_close(out.sound[0], ref_s[0], "sound velocity")
    if req.action is not None:
        assert_close(out.action[0], ref_a[0], "action velocity")
        if mode == "forward_dynamics":
            assert torch.count_nonzero(out.action) == 0  # every row clean -> no velocity


@pytest.mark.parametrize("flavour", ["qwen", "edge"])
def test_attention_bias_and_odd_geometry(flavour):
    cfg = get_config(f"tiny-{flavour}").replace(attention_bias=True)
    ref = build_reference(cfg, seed=7)
    ours = ours_from_reference(ref, cfg)
    req = make_request(cfg, "policy", sound=False, seed=3, latent_hw=(3, 1), frames=1, rows=1, text=1)
    req.vision_clean_frames = []
    kw = reference_kwargs(ref, req)
    ref_v, _, ref_a = ref(**kw, return_dict=False)
    ids, pos, tok = our_inputs(ours, req)
    assert torch.equal(pos[0], kw["position_ids"])
    out = ours(ids, pos, tok)
    assert_close(out.vision[0], ref_v[0][0], "vision velocity")
    assert_close(out.action[0], ref_a[0], "action velocity")


def test_wrong_domain_changes_output_and_bad_domain_is_rejected(models):
    _, ours = models["qwen", False]
    req = make_request(ours.config, "policy", sound=False, seed=5)
    ids, pos, tok = our_inputs(ours, req)
    a = ours(ids, pos, tok).action
    tok.domain_ids = (tok.domain_ids + 1) % ours.config.num_embodiment_domains
    b = ours(ids, pos, tok).action
    assert (a - b).abs().max() > 1e-2
    tok.domain_ids = torch.tensor([ours.config.num_embodiment_domains])
    with pytest.raises(ValueError, match="domain"):
        ours(ids, pos, tok)
