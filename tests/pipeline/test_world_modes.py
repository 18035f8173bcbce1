"""World-generation modes vs diffusers 0.42.1 `Cosmos3OmniPipeline.__call__` without `action` (CPU, fp32).

Both sides get the same tiny Wan2.2 VAE, byte-level tokenizer, tiny sound tokenizer and random
transformer weights (sound heads included); the reference is the real pipeline call, run here. Sizes
are the smallest that still exercise the geometry: 32x48 pixels -> 2x3 latents, whose odd width pads
the 2x2 patch grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from oracle.assets import TinyAssets, picture, tiny_assets
from oracle.scheduler import reference_unipc
from oracle.sound import tiny_sound_tokenizer
from oracle.transformer import build_reference, ours_from_reference

from wamrt.model import Cosmos3Config, Cosmos3Transformer, get_config
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.omni import decode_pixels, pixels_to_uint8
from wamrt.pipeline.sound import SoundDecoder, load_sound_tokenizer
from wamrt.pipeline.world import WorldResult, run_world, world_request

# max |ours - ref| <= TOL * max |ref|, per output. Both sides run the same fp32 ops except where we
# skip work (Reasoner once per branch, encoding only the clean frames); measured gaps are ~1e-7.
LATENT_REL_TOL = 1e-5
PIXEL_REL_TOL = 1e-5
SOUND_REL_TOL = 1e-5

PROMPT = "a red ball rolls across a wooden table"
HEIGHT, WIDTH = 32, 48
STEPS, GUIDANCE, SHIFT = 2, 3.0, 10.0
SOUND_DIM = 8
FLAVOURS = ("tiny-qwen", "tiny-edge")


@dataclass
class Assets(TinyAssets):
    sound_tokenizer: Any = None
    sound: SoundDecoder | None = None


@dataclass
class Stack:
    cfg: Cosmos3Config
    ours: Cosmos3Transformer
    pipe: Cosmos3OmniPipeline


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    snd = tiny_sound_tokenizer(seed=5, sound_dim=SOUND_DIM)
    return Assets(**vars(tiny_assets(tmp_path_factory.mktemp("world"))), sound_tokenizer=snd, sound=SoundDecoder(snd))


@pytest.fixture(scope="module")
def stacks(assets: Assets):
    cache: dict[str, Stack] = {}

    def get(flavour: str) -> Stack:
        if flavour not in cache:
            cfg = get_config(flavour).replace(sound_gen=True, sound_dim=SOUND_DIM)
            ref = build_reference(cfg, seed=17 if flavour == "tiny-qwen" else 18)
            pipe = Cosmos3OmniPipeline(
                transformer=ref,
                text_tokenizer=assets.hf_tokenizer,
                vae=assets.vae,
                scheduler=reference_unipc(SHIFT),
                sound_tokenizer=assets.sound_tokenizer,
                enable_safety_checker=False,
            )
            pipe.set_progress_bar_config(disable=True)
            cache[flavour] = Stack(cfg, ours_from_reference(ref, cfg), pipe)
        return cache[flavour]

    return get


IMAGE = picture(40, 70, 0)  # wider than 32x48: scaled to cover (37x64), centre-cropped
VIDEO = [picture(40, 56, 10 + i) for i in range(7)]  # stretched to 32x48; "last" keeps frames 0..6 -> 9 padded

# One request per mode; the options vary between modes so that each reference switch is crossed once.
CASES: dict[str, dict[str, Any]] = {
    "text2image": {"num_frames": 1, "negative_prompt": "blurry"},
    "text2video": {"num_frames": 5, "negative_prompt": "static, blurry.", "use_system_prompt": False},
    "image2video": {"num_frames": 5, "image": IMAGE, "use_resolution_template": False, "fps": 30.0},
    "video2video": {
        "num_frames": 9, "video": VIDEO, "condition_latent_frames": (0, 2), "condition_video_keep": "last",
        "use_duration_template": False,
    },
    "text2video_sound": {"num_frames": 5, "enable_sound": True, "fps": 16.0},
}

# Our names -> the reference's.
_REFERENCE_NAMES = {
    "condition_latent_frames": "condition_frame_indexes_vision",
    "use_resolution_template": "add_resolution_template",
    "use_duration_template": "add_duration_template",
}


def reference_run(pipe: Cosmos3OmniPipeline, seed: int, **kw: Any) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """The real call with output_type="np"; the final latents and sound latents are recorded on the way."""
    recorded: dict[str, torch.Tensor] = {}

    def on_step_end(_pipe: Any, _i: int, _t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        recorded["latents"] = tensors["latents"].clone()
        return tensors

    decode_sound = pipe.decode_sound

    def recording_decode_sound(latent: torch.Tensor) -> torch.Tensor:
        recorded["sound_latents"] = latent.clone()
        return decode_sound(latent)

    kw = {_REFERENCE_NAMES.get(k, k): v for k, v in kw.items()}
    kw.setdefault("use_system_prompt", True)
    gen = torch.Generator().manual_seed(seed)
    pipe.decode_sound = recording_decode_sound  # instance attribute shadows the method for this call
    try:
        out = pipe(
            prompt=PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
            output_type="np", generator=gen, enable_safety_check=False, callback_on_step_end=on_step_end, **kw,
        )
    finally:
        del pipe.decode_sound
    return out, recorded, gen


def our_run(stack: Stack, assets: Assets, seed: int, *, decode: bool = False, **kw: Any) -> tuple[WorldResult, Any]:
    gen = torch.Generator().manual_seed(seed)
    res = run_world(
        stack.ours, assets.encoder, assets.tokenizer, prompt=PROMPT, height=HEIGHT, width=WIDTH,
        sound_decoder=assets.sound, steps=STEPS, guidance=GUIDANCE, shift=SHIFT, generator=gen, decode=decode, **kw,
    )
    return res, gen


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> float:
    assert ours.dtype == torch.float32, what
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: {tuple(ours.shape)} != {tuple(ref.shape)}"
    scale = ref.float().abs().max().item()
    err = (ours - ref.float()).abs().max().item()
    assert scale > 0, what
    assert err <= tol * scale, f"{what}: max abs diff {err:.3e} > {tol} * {scale:.3e}"
    return err / scale


# ------------------------------------------------------------------------------------------------
# Parity with the real pipeline


def check_parity(stack: Stack, assets: Assets, seed: int, kw: dict[str, Any]) -> None:
    """Run both; compare latents, decoded frames, sound and the generators' final states."""
    ref, recorded, ref_gen = reference_run(stack.pipe, seed, **kw)
    ours, our_gen = our_run(stack, assets, seed, **kw)

    assert_close(ours.video_latents, recorded["latents"], LATENT_REL_TOL, "video latents")
    pixels = decode_pixels(assets.encoder, ours.video_latents)  # [T, H, W, 3] in [0, 1]
    assert pixels.shape == (kw["num_frames"], HEIGHT, WIDTH, 3)
    assert_close(pixels, torch.from_numpy(ref.video), PIXEL_REL_TOL, "decoded frames")
    # uint8 frames: the reference's rounding of its own floats; ~1e-7 apart may flip a .5 boundary.
    ref_u8 = (ref.video * 255).round().astype(np.uint8)
    diff = np.abs(pixels_to_uint8(pixels).numpy().astype(int) - ref_u8.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2

    if kw.get("enable_sound"):
        assert ours.sound_latents is not None and ref.sound is not None
        assert_close(ours.sound_latents, recorded["sound_latents"], LATENT_REL_TOL, "sound latents")
        assert_close(assets.sound.decode(ours.sound_latents), ref.sound, SOUND_REL_TOL, "sound")
    else:
        assert ours.sound_latents is None and ref.sound is None
    # Same draws in the same order: both generators end in the same state.
    assert torch.equal(our_gen.get_state(), ref_gen.get_state())


@pytest.mark.parity
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("case", list(CASES))
def test_world_mode_matches_diffusers(stacks, assets, case: str, flavour: str) -> None:
    seed = 10 * list(CASES).index(case) + FLAVOURS.index(flavour)
    check_parity(stacks(flavour), assets, seed, CASES[case])


@pytest.mark.parity
def test_sound_for_a_given_video_matches_diffusers(stacks, assets) -> None:
    # Every latent frame clean: the video is kept (zero velocity) and only the sound is generated.
    kw = {"num_frames": 5, "video": VIDEO[:5], "condition_latent_frames": (0, 1), "enable_sound": True}
    check_parity(stacks("tiny-qwen"), assets, 99, kw)


def test_decode_returns_uint8_frames_and_the_waveform(stacks, assets) -> None:
    kw = CASES["text2video_sound"]
    res, _ = our_run(stacks("tiny-qwen"), assets, 3, decode=True, **kw)
    assert res.frames is not None and res.sound is not None and res.sound_latents is not None
    assert res.frames.dtype == torch.uint8 and tuple(res.frames.shape) == (5, HEIGHT, WIDTH, 3)
    assert torch.equal(res.frames, pixels_to_uint8(decode_pixels(assets.encoder, res.video_latents)))
    assert torch.equal(res.sound, assets.sound.decode(res.sound_latents))
    # 5 frames at 16 fps = 500 samples at 1600 Hz -> 8 latent frames of 64 samples.
    assert tuple(res.sound_latents.shape) == (SOUND_DIM, 8) and tuple(res.sound.shape) == (2, 8 * 64)
    for stage in ("tokenize", "preprocess", "vae_encode", "reasoner_prefill", "denoise", "vae_decode",
                  "sound_decode", "total"):
        assert stage in res.timings_ms, stage


# ------------------------------------------------------------------------------------------------
# Captions and conditioning pixels against the reference's own helpers (no transformer, no VAE)

CAPTION_CASES = [
    {"num_frames": 1},
    {"num_frames": 1, "negative_prompt": "dark", "use_system_prompt": False},
    {"num_frames": 9, "fps": 12.5, "negative_prompt": "bad. "},
    {"num_frames": 189, "fps": 24.0, "use_duration_template": False},
    {"num_frames": 5, "use_resolution_template": False, "use_duration_template": False, "negative_prompt": "."},
]


@pytest.mark.parity
@pytest.mark.parametrize("i", range(len(CAPTION_CASES)))
@pytest.mark.parametrize("prompt", ["a cat on a mat", "A cat on a mat...", ""])
def test_caption_tokens_match_diffusers(stacks, assets, prompt: str, i: int) -> None:
    kw = {"height": 64, "width": 96, "use_system_prompt": True, **CAPTION_CASES[i]}
    req = world_request(prompt=prompt, **kw)
    cond, uncond = stacks("tiny-qwen").pipe.tokenize_prompt(
        prompt, kw.get("negative_prompt"), num_frames=kw["num_frames"], height=64, width=96,
        fps=kw.get("fps", 24.0), use_system_prompt=kw["use_system_prompt"],
        add_resolution_template=kw.get("use_resolution_template", True),
        add_duration_template=kw.get("use_duration_template", True),
    )
    ours_cond, ours_uncond = req.captions()
    assert list(assets.tokenizer.encode(ours_cond, req.system_prompt).text_ids) == cond
    assert list(assets.tokenizer.encode(ours_uncond, req.system_prompt).text_ids) == uncond


def reference_encoder_input(pipe: Cosmos3OmniPipeline, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip the reference hands its VAE, and its vision condition mask (the VAE itself is stubbed)."""
    seen: list[torch.Tensor] = []
    lat_t = (kw["num_frames"] - 1) // 4 + 1

    def stub_encode(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return torch.zeros(1, 48, lat_t, kw["height"] // 16, kw["width"] // 16)

    kw = {_REFERENCE_NAMES.get(k, k): v for k, v in kw.items()}
    pipe._encode_video = stub_encode
    try:
        out = pipe.prepare_latents(generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32,
                                   **kw)
    finally:
        del pipe._encode_video
    return seen[0], out[5][:, 0, 0]


@pytest.mark.parity
@pytest.mark.parametrize("hw", [(40, 70), (20, 20), (33, 50), (100, 60)], ids=lambda hw: f"{hw[0]}x{hw[1]}")
@pytest.mark.parametrize("out_hw", [(32, 48), (64, 32)], ids=lambda hw: f"to{hw[0]}x{hw[1]}")
def test_image_conditioning_matches_diffusers(stacks, hw: tuple[int, int], out_hw: tuple[int, int]) -> None:
    img = picture(*hw, seed=hw[0])
    kw = {"num_frames": 5, "height": out_hw[0], "width": out_hw[1]}
    ref_clip, ref_mask = reference_encoder_input(stacks("tiny-qwen").pipe, image=img, **kw)
    for given in (img, np.array(img)):
        req = world_request(prompt="", image=given, **kw)
        ours = req.conditioning_clip()
        assert ours is not None and ours.shape[2] == 1  # frame 0 only
        assert torch.equal(ours[:, :, 0], ref_clip[:, :, 0])
    assert torch.equal(ref_clip[:, :, 0], ref_clip[:, :, -1])  # the reference encodes repeated copies
    assert ref_mask.nonzero().flatten().tolist() == list(req.clean_latent_frames) == [0]


@pytest.mark.parity
@pytest.mark.parametrize("frames", [3, 12])
@pytest.mark.parametrize("keep", ["first", "last"])
@pytest.mark.parametrize("cond", [(0, 1), (2, 0), (1,)])
def test_video_conditioning_matches_diffusers(stacks, frames: int, keep: str, cond: tuple[int, ...]) -> None:
    video = [picture(40 + i, 56, 30 + i) for i in range(frames)]  # sizes differ: each is stretched anyway
    kw = {"num_frames": 9, "height": HEIGHT, "width": WIDTH, "condition_latent_frames": cond,
          "condition_video_keep": keep}
    ref_clip, ref_mask = reference_encoder_input(stacks("tiny-qwen").pipe, video=video, **kw)
    req = world_request(prompt="", video=video, **kw)
    ours = req.conditioning_clip()
    assert ours is not None and ours.shape[2] == 4 * max(cond) + 1
    assert torch.equal(ours, ref_clip[:, :, : ours.shape[2]])
    assert ref_mask.nonzero().flatten().tolist() == list(req.clean_latent_frames)
    arrays = world_request(prompt="", video=np.stack([np.array(f) for f in video[:1]] * 2), **kw)
    assert torch.equal(arrays.conditioning_clip(), world_request(prompt="", video=[video[0]] * 2,
                                                                 **kw).conditioning_clip())


def test_text_modes_encode_nothing() -> None:
    assert world_request(prompt="x", num_frames=1, height=16, width=16).conditioning_clip() is None
    req = world_request(prompt="x", num_frames=5, height=16, width=16)
    assert req.mode == "text2video" and req.conditioning_clip() is None and req.clean_latent_frames == ()


def test_sound_tokenizer_folder_round_trip(assets, tmp_path) -> None:
    assets.sound_tokenizer.save_pretrained(str(tmp_path))
    loaded = SoundDecoder(load_sound_tokenizer(tmp_path))
    z = torch.randn(SOUND_DIM, 3, generator=torch.Generator().manual_seed(0))
    assert (loaded.sampling_rate, loaded.hop_size) == (assets.sound.sampling_rate, assets.sound.hop_size)
    assert torch.equal(loaded.decode(z), assets.sound.decode(z))


# ------------------------------------------------------------------------------------------------
# Typed errors

REQUEST_ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "frames_zero": ({"num_frames": 0}, "num_frames"),
    "frames_not_4k_plus_1": ({"num_frames": 6}, "num_frames"),
    "frames_float": ({"num_frames": 5.0}, "num_frames"),
    "frames_bool": ({"num_frames": True}, "num_frames"),
    "height_not_16x": ({"height": 40}, "height"),
    "width_not_16x": ({"width": 50}, "width"),
    "width_zero": ({"width": 0}, "width"),
    "height_str": ({"height": "32"}, "height"),
    "fps_nan": ({"fps": float("nan")}, "fps"),
    "fps_inf": ({"fps": float("inf")}, "fps"),
    "fps_zero": ({"fps": 0.0}, "fps"),
    "prompt_not_str": ({"prompt": None}, "prompt"),
    "negative_not_str": ({"negative_prompt": 3}, "negative_prompt"),
    "image_and_video": ({"image": IMAGE, "video": VIDEO}, "image"),
    "image_for_one_frame": ({"image": IMAGE, "num_frames": 1}, "image"),
    "video_for_one_frame": ({"video": VIDEO, "num_frames": 1}, "video"),
    "gray_image": ({"image": IMAGE.convert("L")}, "image"),
    "float_image": ({"image": np.zeros((32, 48, 3), np.float32)}, "image"),
    "empty_video": ({"video": []}, "video"),
    "bad_video_frame": ({"video": [VIDEO[0], "frame"]}, "video[1]"),
    "condition_without_video": ({"condition_latent_frames": (0,)}, "condition_latent_frames"),
    "condition_out_of_range": ({"video": VIDEO, "condition_latent_frames": (0, 2)}, "condition_latent_frames"),
    "condition_empty": ({"video": VIDEO, "condition_latent_frames": ()}, "condition_latent_frames"),
    "condition_negative": ({"video": VIDEO, "condition_latent_frames": (-1,)}, "condition_latent_frames"),
    "condition_bool": ({"video": VIDEO, "condition_latent_frames": (True,)}, "condition_latent_frames"),
    "condition_str": ({"video": VIDEO, "condition_latent_frames": "01"}, "condition_latent_frames"),
    "keep_unknown": ({"video": VIDEO, "condition_video_keep": "middle"}, "condition_video_keep"),
    "sound_not_bool": ({"enable_sound": "yes"}, "enable_sound"),
    "system_prompt_not_bool": ({"use_system_prompt": "false"}, "use_system_prompt"),
}


@pytest.mark.parametrize("case", list(REQUEST_ERRORS))
def test_request_errors(case: str) -> None:
    over, field = REQUEST_ERRORS[case]
    kw: dict[str, Any] = {"prompt": PROMPT, "num_frames": 5, "height": HEIGHT, "width": WIDTH, **over}
    with pytest.raises(RequestError) as e:
        world_request(**kw)
    assert e.value.field == field, str(e.value)


def test_model_errors(assets) -> None:
    cfg = get_config("tiny-qwen").replace(sound_gen=True, sound_dim=SOUND_DIM)
    sound = world_request(prompt=PROMPT, num_frames=5, height=HEIGHT, width=WIDTH, enable_sound=True)
    silent = world_request(prompt=PROMPT, num_frames=5, height=HEIGHT, width=WIDTH)
    other_sound = SoundDecoder(tiny_sound_tokenizer(seed=1, sound_dim=4))
    too_fast = world_request(prompt=PROMPT, num_frames=1, height=HEIGHT, width=WIDTH, fps=1e4, enable_sound=True)
    cases = [
        (sound, get_config("tiny-qwen"), assets.sound, "enable_sound"),  # no sound heads
        (sound, cfg, None, "sound_decoder"),
        (sound, cfg, other_sound, "sound_decoder"),  # 4 latent channels, the model makes 8
        (too_fast, cfg, assets.sound, "fps"),  # 1 frame at 10^4 fps: no whole sound sample
        (silent, cfg.replace(latent_channel=16, patch_latent_dim=64), None, "vae"),
        (silent, cfg.replace(vocab_size=100), None, "tokenizer"),
    ]
    for req, model_cfg, decoder, field in cases:
        with pytest.raises(RequestError) as e:
            req.prepare(model_cfg, assets.encoder, assets.tokenizer, sound_decoder=decoder)
        assert e.value.field == field, str(e.value)


def test_sampling_errors(stacks, assets) -> None:
    for over, field in (({"steps": 0}, "steps"), ({"guidance": float("nan")}, "guidance"), ({"shift": 0.0}, "shift")):
        with pytest.raises(RequestError) as e:
            run_world(stacks("tiny-qwen").ours, assets.encoder, assets.tokenizer, prompt=PROMPT, num_frames=5,
                      height=HEIGHT, width=WIDTH, **over)
        assert e.value.field == field


# The reference refuses these too (in `check_inputs`); the rest of REQUEST_ERRORS it runs and
# silently ignores or mis-handles.
REFERENCE_REFUSES = ["height_not_16x", "frames_zero", "image_and_video", "video_for_one_frame",
                     "condition_out_of_range", "condition_empty", "condition_negative", "condition_str"]


@pytest.mark.parametrize("case", REFERENCE_REFUSES)
def test_reference_refuses_the_same(stacks, case: str) -> None:
    over = {_REFERENCE_NAMES.get(k, k): v for k, v in REQUEST_ERRORS[case][0].items()}
    kw: dict[str, Any] = {"prompt": PROMPT, "negative_prompt": None, "image": None, "height": HEIGHT,
                          "width": WIDTH, "num_frames": 5, "guidance_scale": 3.0, "enable_sound": False,
                          "callback_on_step_end_tensor_inputs": ["latents"], **over}
    with pytest.raises(ValueError):
        stacks("tiny-qwen").pipe.check_inputs(**kw)
