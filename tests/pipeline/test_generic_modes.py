"""Generic action contracts vs diffusers 0.42.1 `Cosmos3OmniPipeline.__call__` (Oracle 2, CPU, fp32).

Both sides get the same tiny Wan2.2 VAE, the same byte-level tokenizer and the same random transformer
weights; the reference is the real pipeline call with `CosmosActionCondition`. Images are PIL (the
reference mis-scales uint8 numpy input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from diffusers.video_processor import VideoProcessor
from oracle.assets import TinyAssets, picture, tiny_assets
from oracle.scheduler import reference_unipc
from oracle.transformer import build_reference, ours_from_reference

from wamrt.model import Cosmos3Config, Cosmos3Transformer, get_config
from wamrt.pipeline.domains import DOMAIN_IDS, RAW_ACTION_DIMS, action_domains, resolve_domain
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.generic import (
    GenericResult,
    decode_frames,
    diffusers_sampling,
    generic_request,
    run_generic,
)
from wamrt.pipeline.geometry import DIFFUSERS_ACTION_RESOLUTION_BINS

pytestmark = pytest.mark.parity

REL_TOL = 1e-5  # max |ours - ref| <= REL_TOL * max |ref|
PROMPT = "pick up the red cup and put it in the bowl"
CHUNK = 4  # 5 pixel frames -> 2 latent frames: the smallest chunk with a noisy vision frame


@dataclass
class Stack:
    cfg: Cosmos3Config
    ours: Cosmos3Transformer
    pipe: Cosmos3OmniPipeline


def reference_scheduler() -> UniPCMultistepScheduler:
    return reference_unipc(5.0)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory.mktemp("generic"))


@pytest.fixture(scope="module")
def stacks(assets: TinyAssets):
    cache: dict[str, Stack] = {}

    def get(flavour: str) -> Stack:
        if flavour not in cache:
            cfg = get_config(flavour)
            ref = build_reference(cfg, seed=7 if flavour == "tiny-qwen" else 8)
            pipe = Cosmos3OmniPipeline(
                transformer=ref,
                text_tokenizer=assets.hf_tokenizer,
                vae=assets.vae,
                scheduler=reference_scheduler(),
                enable_safety_checker=False,
                default_use_system_prompt=False,
            )
            pipe.set_progress_bar_config(disable=True)
            cache[flavour] = Stack(cfg, ours_from_reference(ref, cfg), pipe)
        return cache[flavour]

    return get


IMAGE = picture(48, 64, 0)  # tier 256 -> 256x320 canvas, replicate pad, 3x4 latent (odd rows -> patch pad)
VIDEO = [picture(48, 64, 10 + i) for i in range(CHUNK + 1)]
RAW = torch.randn(CHUNK, 10, generator=torch.Generator().manual_seed(3))  # droid_lerobot: 10 columns


def reference_run(
    pipe: Cosmos3OmniPipeline,
    *,
    mode: str,
    steps: int,
    guidance: float,
    seed: int,
    chunk: int = CHUNK,
    domain: str = "droid_lerobot",
    tier: int = 256,
    image: Any = None,
    video: Any = None,
    raw_actions: torch.Tensor | None = None,
    view_point: str | None = "ego_view",
    fps: float = 15.0,
    prompt: str = PROMPT,
    negative_prompt: str | None = None,
    use_system_prompt: bool = False,
    output_type: str = "latent",
):
    action = CosmosActionCondition(
        mode=mode,
        chunk_size=chunk,
        domain_name=domain,
        resolution_tier=tier,
        raw_actions=raw_actions,
        image=image,
        video=video,
        view_point=view_point,
    )
    gen = torch.Generator().manual_seed(seed)
    out = pipe(
        prompt=prompt,
        negative_prompt=negative_prompt,
        action=action,
        fps=fps,
        num_inference_steps=steps,
        guidance_scale=guidance,
        output_type=output_type,
        generator=gen,
        enable_safety_check=False,
        use_system_prompt=use_system_prompt,
    )
    return out, gen


def our_run(
    stack: Stack,
    assets: TinyAssets,
    *,
    mode: str,
    steps: int,
    guidance: float,
    seed: int,
    chunk: int = CHUNK,
    domain: str = "droid_lerobot",
    tier: int = 256,
    image: Any = None,
    video: Any = None,
    raw_actions: torch.Tensor | None = None,
    view_point: str | None = "ego_view",
    fps: float = 15.0,
    prompt: str = PROMPT,
    negative_prompt: str | None = None,
    use_system_prompt: bool = False,
    decode: bool = False,
) -> tuple[GenericResult, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    res = run_generic(
        stack.ours,
        assets.encoder,
        assets.tokenizer,
        mode=mode,
        prompt=prompt,
        domain=domain,
        chunk_size=chunk,
        image=image,
        video=video,
        raw_actions=raw_actions,
        resolution_tier=tier,
        view_point=view_point,
        fps=fps,
        negative_prompt=negative_prompt,
        use_system_prompt=use_system_prompt,
        steps=steps,
        guidance=guidance,
        shift=5.0,
        generator=gen,
        decode=decode,
    )
    return res, gen


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.dtype == torch.float32, what
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: {tuple(ours.shape)} != {tuple(ref.shape)}"
    scale = ref.float().abs().max().item()
    err = (ours - ref.float()).abs().max().item()
    assert scale > 0, what
    assert err <= REL_TOL * scale, f"{what}: max abs diff {err:.3e} > {REL_TOL} * {scale:.3e}"


def compare(stack: Stack, assets: TinyAssets, **kw: Any) -> tuple[GenericResult, Any]:
    """Run both, check actions, video latents and the generators' final states."""
    ref, ref_gen = reference_run(stack.pipe, **kw)
    ours, our_gen = our_run(stack, assets, **kw)
    assert_close(ours.video_latents, ref.video, "video latents")
    if kw["mode"] == "forward_dynamics":
        assert ref.action is None and ours.actions is None
    else:
        assert ours.actions is not None and ref.action is not None
        assert_close(ours.actions, ref.action[0], "actions")
    # Same draws in the same order: both generators end in the same state.
    assert torch.equal(our_gen.get_state(), ref_gen.get_state())
    return ours, ref


def mode_inputs(mode: str) -> dict[str, Any]:
    if mode == "inverse_dynamics":
        return {"video": VIDEO}
    if mode == "forward_dynamics":
        return {"image": IMAGE, "raw_actions": RAW}
    return {"image": IMAGE}


MODES = ("policy", "forward_dynamics", "inverse_dynamics")


# ------------------------------------------------------------------------------------------------
# Parity with the real pipeline


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_diffusers(stacks, assets, mode: str, steps: int, guidance: float) -> None:
    seed = 100 * steps + int(guidance) + MODES.index(mode)
    compare(
        stacks("tiny-qwen"), assets, mode=mode, steps=steps, guidance=guidance, seed=seed, **mode_inputs(mode)
    )


@pytest.mark.parametrize("mode", MODES)
def test_edge_flavour_matches_diffusers(stacks, assets, mode: str) -> None:
    compare(stacks("tiny-edge"), assets, mode=mode, steps=2, guidance=3.0, seed=5, **mode_inputs(mode))


def test_system_prompt_negative_prompt_and_metadata(stacks, assets) -> None:
    # System prompt on both branches, a negative prompt, another view point, domain (30 raw columns),
    # chunk, fps, and an image whose size is not a multiple of 16 (resized to 48x80 first).
    compare(
        stacks("tiny-qwen"),
        assets,
        mode="policy",
        steps=2,
        guidance=4.5,
        seed=9,
        chunk=5,
        domain="galbot",
        image=picture(50, 87, 4),
        view_point="third_person_view",
        fps=10.0,
        negative_prompt="blurry, static",
        use_system_prompt=True,
    )


def test_no_view_point_and_downscaled_image(stacks, assets) -> None:
    # 288x368 at tier 256: bicubic shrink to 250x320 and a 6-row reflect pad; 15x20 latent.
    compare(
        stacks("tiny-edge"),
        assets,
        mode="policy",
        steps=2,
        guidance=3.0,
        seed=21,
        image=picture(288, 368, 5),
        view_point=None,
        domain="bridge_orig_lerobot",
    )


@pytest.mark.parametrize("rows", [2, 7])
def test_forward_dynamics_pads_or_truncates_actions(stacks, assets, rows: int) -> None:
    raw = torch.randn(rows, 9, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
    compare(
        stacks("tiny-qwen"),
        assets,
        mode="forward_dynamics",
        steps=2,
        guidance=3.0,
        seed=rows,
        image=IMAGE,
        raw_actions=raw,
        domain="camera_pose",
    )


@pytest.mark.parametrize("frames", [3, 7])
def test_inverse_dynamics_pads_or_truncates_video(stacks, assets, frames: int) -> None:
    video = [picture(48, 64, 50 + i) for i in range(frames)]
    compare(
        stacks("tiny-qwen"), assets, mode="inverse_dynamics", steps=2, guidance=3.0, seed=frames, video=video
    )


def test_policy_from_video_uses_frame0_only(stacks, assets) -> None:
    ours, _ = compare(stacks("tiny-qwen"), assets, mode="policy", steps=2, guidance=3.0, seed=4, video=VIDEO)
    image_only, _ = our_run(
        stacks("tiny-qwen"), assets, mode="policy", steps=2, guidance=3.0, seed=4, image=VIDEO[0]
    )
    assert torch.equal(ours.video_latents, image_only.video_latents)
    assert ours.actions is not None and image_only.actions is not None
    assert torch.equal(ours.actions, image_only.actions)


def test_short_chunk_has_no_noisy_vision_frame(stacks, assets) -> None:
    # chunk 2 -> 3 pixel frames -> 1 latent frame, all clean even in policy mode; only actions denoise.
    ours, _ref = compare(
        stacks("tiny-qwen"), assets, mode="policy", steps=2, guidance=3.0, seed=2, chunk=2, image=IMAGE
    )
    assert ours.video_latents.shape[2] == 1


@pytest.mark.parametrize(
    "tier,mode,chunk", [(480, "policy", 4), (704, "forward_dynamics", 1), (720, "inverse_dynamics", 1)]
)
def test_higher_tiers_match_diffusers(stacks, assets, tier: int, mode: str, chunk: int) -> None:
    # Small chunks keep the reference's full-clip encode of a 640x640 / 960x960 canvas affordable.
    img = picture(60, 80, tier)
    inputs: dict[str, Any] = (
        {"video": [img, picture(60, 80, tier + 1)]} if mode == "inverse_dynamics" else {"image": img}
    )
    if mode == "forward_dynamics":
        inputs["raw_actions"] = RAW
    compare(
        stacks("tiny-qwen"),
        assets,
        mode=mode,
        steps=2,
        guidance=3.0,
        seed=tier,
        chunk=chunk,
        tier=tier,
        **inputs,
    )


def test_uint8_array_equals_pil(stacks, assets) -> None:
    stack = stacks("tiny-qwen")
    kw = {"mode": "policy", "steps": 1, "guidance": 3.0, "seed": 0}
    a, _ = our_run(stack, assets, image=np.array(IMAGE), **kw)
    b, _ = our_run(stack, assets, image=IMAGE, **kw)
    assert torch.equal(a.video_latents, b.video_latents) and torch.equal(a.actions, b.actions)
    v = generic_request(
        mode="inverse_dynamics",
        prompt="",
        domain="umi",
        chunk_size=4,
        resolution_tier=256,
        video=np.stack([np.array(f) for f in VIDEO]),
    )
    w = generic_request(
        mode="inverse_dynamics", prompt="", domain="umi", chunk_size=4, resolution_tier=256, video=VIDEO
    )
    assert torch.equal(v.pixel_clip(), w.pixel_clip())


# ------------------------------------------------------------------------------------------------
# Conditioning geometry / prompts at every tier (no VAE; the reference's own helpers)

TIER_IMAGES = [(50, 70), (300, 500), (720, 1280), (1000, 600)]


@pytest.mark.parametrize("tier", [256, 480, 704, 720])
@pytest.mark.parametrize("hw", TIER_IMAGES, ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_tier_canvas_pixels_and_tokens_match_diffusers(
    stacks, assets, tier: int, hw: tuple[int, int]
) -> None:
    pipe = stacks("tiny-qwen").pipe
    img = picture(*hw, seed=hw[0])
    probe = pipe.video_processor.preprocess_video([img])
    canvas = VideoProcessor.classify_height_width_bin(
        int(probe.shape[-2]), int(probe.shape[-1]), ratios=DIFFUSERS_ACTION_RESOLUTION_BINS[str(tier)]
    )
    frames, image_size, th, tw = pipe._prepare_action_video_conditioning(
        [img], tier, 2, device=torch.device("cpu"), dtype=torch.float32
    )
    req = generic_request(
        mode="policy",
        prompt=PROMPT,
        domain="droid_lerobot",
        chunk_size=1,
        resolution_tier=tier,
        image=img,
        fps=15.0,
        view_point="wrist_view",
        negative_prompt="bad",
        use_system_prompt=True,
    )
    assert (req.canvas.canvas_h, req.canvas.canvas_w) == canvas == (th, tw)
    assert list(req.canvas.image_size) == image_size.int().tolist()
    ours = req.pixel_clip()
    assert ours.shape[2] == 1  # policy: frame 0 only
    assert torch.equal(ours[:, :, 0], frames[:, :, 0])
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])  # the reference encodes repeated copies
    cond, uncond = pipe.tokenize_prompt(
        PROMPT,
        "bad",
        num_frames=2,
        height=th,
        width=tw,
        fps=15.0,
        use_system_prompt=True,
        action_mode="policy",
        action_view_point="wrist_view",
    )
    ours_cond, ours_uncond = req.captions()
    assert list(assets.tokenizer.encode(ours_cond, req.system_prompt).text_ids) == cond
    assert list(assets.tokenizer.encode(ours_uncond, req.system_prompt).text_ids) == uncond


def test_inverse_dynamics_encodes_every_frame_policy_only_frame0() -> None:
    kw = {"prompt": "", "domain": "droid_lerobot", "chunk_size": 8, "resolution_tier": 256}
    assert generic_request(mode="inverse_dynamics", video=VIDEO, **kw).pixel_clip().shape[2] == 9
    assert generic_request(mode="policy", video=VIDEO, **kw).pixel_clip().shape[2] == 1
    assert (
        generic_request(mode="forward_dynamics", image=IMAGE, raw_actions=RAW, **kw).pixel_clip().shape[2]
        == 1
    )


# ------------------------------------------------------------------------------------------------
# Decode (forward dynamics)


def test_forward_dynamics_decode_matches_diffusers(stacks, assets) -> None:
    stack = stacks("tiny-qwen")
    kw = {
        "mode": "forward_dynamics",
        "steps": 2,
        "guidance": 3.0,
        "seed": 13,
        "image": IMAGE,
        "raw_actions": RAW,
    }
    ref_latents, _ = reference_run(stack.pipe, **kw)
    ref_pil, _ = reference_run(stack.pipe, output_type="pil", **kw)
    ref_frames = np.stack([np.asarray(f) for f in ref_pil.video])  # [T, H, W, 3] uint8
    ours, _ = our_run(stack, assets, decode=True, **kw)
    assert ours.frames is not None
    assert ours.frames.dtype == torch.uint8 and tuple(ours.frames.shape) == (CHUNK + 1, 48, 64, 3)
    assert ref_frames.shape == tuple(ours.frames.shape)
    # Same latents in -> the very same bytes out (un-normalise, decode, [0, 1], round half to even).
    assert np.array_equal(decode_frames(assets.encoder, ref_latents.video).numpy(), ref_frames)
    # Our own latents differ from the reference's by ~1e-7, which may flip a rounding boundary.
    diff = np.abs(ours.frames.numpy().astype(int) - ref_frames.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    again, _ = our_run(stack, assets, decode=True, **kw)
    assert again.frames is not None and torch.equal(again.frames, ours.frames)
    assert "vae_decode" in ours.timings_ms and "denoise" in ours.timings_ms


# ------------------------------------------------------------------------------------------------
# Registry and typed errors


def test_domain_registry() -> None:
    assert set(action_domains()) == set(RAW_ACTION_DIMS) <= set(DOMAIN_IDS)
    d = resolve_domain("robomind-franka")
    assert (d.domain_id, d.raw_action_dim) == (8, 10)
    for bad in ("libero", "no_action", "droid", 3):
        with pytest.raises(RequestError) as e:
            resolve_domain(bad)
        assert e.value.field == "domain"


def base_kwargs(**over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "mode": "policy",
        "prompt": PROMPT,
        "domain": "droid_lerobot",
        "chunk_size": CHUNK,
        "resolution_tier": 256,
        "image": IMAGE,
    }
    kw.update(over)
    return kw


NAN_RAW = RAW.clone()
NAN_RAW[1, 2] = float("nan")

REQUEST_ERRORS = {
    "unknown_mode": ({"mode": "video2world"}, "mode"),
    "unknown_domain": ({"domain": "droid"}, "domain"),
    "widthless_domain": ({"domain": "libero"}, "domain"),
    "chunk_zero": ({"chunk_size": 0}, "chunk_size"),
    "chunk_bool": ({"chunk_size": True}, "chunk_size"),
    "bad_tier": ({"resolution_tier": 512}, "resolution_tier"),
    "bad_view_point": ({"view_point": "ego-view"}, "view_point"),
    "fps_nan": ({"fps": float("nan")}, "fps"),
    "fps_zero": ({"fps": 0.0}, "fps"),
    "prompt_not_str": ({"prompt": None}, "prompt"),
    "no_image": ({"image": None}, "image"),
    "image_and_video": ({"video": VIDEO}, "image"),
    "inverse_needs_video": ({"mode": "inverse_dynamics"}, "video"),
    "forward_needs_raw": ({"mode": "forward_dynamics"}, "raw_actions"),
    "raw_wrong_width": ({"mode": "forward_dynamics", "raw_actions": torch.zeros(4, 7)}, "raw_actions"),
    "raw_1d": ({"mode": "forward_dynamics", "raw_actions": torch.zeros(10)}, "raw_actions"),
    "raw_nan": ({"mode": "forward_dynamics", "raw_actions": NAN_RAW}, "raw_actions"),
    "raw_overflow": (
        {"mode": "forward_dynamics", "raw_actions": torch.full((2, 10), 1e300, dtype=torch.float64)},
        "raw_actions",
    ),
    "raw_for_policy": ({"raw_actions": RAW}, "raw_actions"),
    "float_image": ({"image": np.zeros((48, 64, 3), np.float32)}, "image"),
    "gray_image": ({"image": IMAGE.convert("L")}, "image"),
    "tiny_image": ({"image": picture(12, 64, 0)}, "image"),
    "mixed_video_sizes": (
        {"mode": "inverse_dynamics", "image": None, "video": [IMAGE, picture(64, 64, 1)]},
        "video",
    ),
    "empty_video": ({"mode": "inverse_dynamics", "image": None, "video": []}, "video"),
}


@pytest.mark.parametrize("case", list(REQUEST_ERRORS))
def test_request_errors(case: str) -> None:
    over, field = REQUEST_ERRORS[case]
    with pytest.raises(RequestError) as e:
        generic_request(**base_kwargs(**over))
    assert e.value.field == field, str(e.value)


# The cases the reference refuses too (same contract, typed here).
REFERENCE_REFUSES = {
    "unknown_domain": {"domain_name": "droid"},
    "widthless_domain": {"domain_name": "libero"},
    "inverse_needs_video": {"mode": "inverse_dynamics"},
    "forward_needs_raw": {"mode": "forward_dynamics"},
    "raw_wrong_width": {"mode": "forward_dynamics", "raw_actions": torch.zeros(4, 7)},
    "image_and_video": {"video": VIDEO},
}


@pytest.mark.parametrize("case", list(REFERENCE_REFUSES))
def test_reference_refuses_the_same(case: str) -> None:
    kw: dict[str, Any] = {
        "mode": "policy",
        "chunk_size": CHUNK,
        "domain_name": "droid_lerobot",
        "resolution_tier": 256,
        "image": IMAGE,
    }
    kw.update(REFERENCE_REFUSES[case])
    with pytest.raises(ValueError):
        CosmosActionCondition(**kw)
    with pytest.raises(RequestError):
        generic_request(
            **base_kwargs(
                **{k.replace("domain_name", "domain"): v for k, v in REFERENCE_REFUSES[case].items()}
            )
        )


def test_model_errors(assets) -> None:
    req = generic_request(**base_kwargs(domain="galbot"))  # 30 raw columns
    cfg = get_config("tiny-qwen")
    cases = {
        "domain": cfg.replace(action_dim=16),  # the domain needs more columns than the model has
        "model": cfg.replace(action_gen=False, action_dim=None),
        "vae": cfg.replace(latent_channel=16, patch_latent_dim=64),
    }
    for field, bad in cases.items():
        with pytest.raises(RequestError) as e:
            req.prepare(bad, assets.encoder, assets.tokenizer)
        assert e.value.field == field


@pytest.mark.parametrize(
    "over,field",
    [({"steps": 0}, "steps"), ({"guidance": float("nan")}, "guidance"), ({"shift": -1.0}, "shift")],
)
def test_sampling_errors(over: dict[str, Any], field: str) -> None:
    kw: dict[str, Any] = {"steps": 2, "guidance": 3.0, "shift": 5.0}
    kw.update(over)
    with pytest.raises(RequestError) as e:
        diffusers_sampling(**kw)
    assert e.value.field == field
