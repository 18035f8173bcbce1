"""Distilled world generation vs diffusers 0.42.1 `Cosmos3DistilledModularPipeline` (CPU, fp32).

The reference is the real modular pipeline (`Cosmos3DistilledBlocks`: distilled text step, VAE
conditioning, fixed-sigma FlowMatchEuler loop with the generator passed to every step, re-anchoring,
decode), assembled from the same tiny components as the world-mode tests and called here with the
same seed as ours. Sizes: 32x48 pixels -> 2x3 latents (the odd width pads the patch grid).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.modular_pipelines import Cosmos3DistilledBlocks, Cosmos3DistilledModularPipeline
from oracle.assets import TinyAssets, picture, tiny_assets
from oracle.transformer import build_reference, ours_from_reference

from wamrt.model import Cosmos3Config, Cosmos3Transformer, get_config
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.omni import decode_pixels, pixels_to_uint8
from wamrt.pipeline.world import WorldResult, world_request
from wamrt.pipeline.world_distilled import (
    DistilledCheckpointError,
    load_distilled_schedule,
    run_world_distilled,
)
from wamrt.sampler import DistilledSchedule

# max |ours - ref| <= TOL * max |ref|. Both sides run the same fp32 ops (the steps are bitwise equal,
# tests/sampler/test_distilled.py); the gap comes from the transformer (Reasoner K/V reused across
# steps) and from encoding only the clean frames. Measured ~1e-7 (latents) and ~1e-6 (pixels).
LATENT_REL_TOL = 1e-5
PIXEL_REL_TOL = 1e-5

PROMPT = "a red ball rolls across a wooden table"
HEIGHT, WIDTH = 32, 48
SOUND_DIM = 8  # the tiny models carry sound heads; the distilled path must leave them unused
FLAVOURS = ("tiny-qwen", "tiny-edge")
# Sigma 1 first, then non-integer timesteps (833.3..., 412.5): what a 4-step distilled config looks like.
SIGMAS = (1.0, 0.8333, 0.4125, 0.2)


@dataclass
class Stack:
    cfg: Cosmos3Config
    ref: Any
    ours: Cosmos3Transformer


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory.mktemp("world_distilled"))


@pytest.fixture(scope="module")
def stacks():
    cache: dict[str, Stack] = {}

    def get(flavour: str) -> Stack:
        if flavour not in cache:
            cfg = get_config(flavour).replace(sound_gen=True, sound_dim=SOUND_DIM)
            ref = build_reference(cfg, seed=27 if flavour == "tiny-qwen" else 28)
            cache[flavour] = Stack(cfg, ref, ours_from_reference(ref, cfg))
        return cache[flavour]

    return get


def reference_pipeline(stack: Stack, assets: TinyAssets,
                       schedule: DistilledSchedule) -> Cosmos3DistilledModularPipeline:
    """The modular pipeline as a distilled checkpoint would configure it (sigmas in its config, the
    scheduler's shift and stochastic_sampling), with the tiny components swapped in."""
    pipe = Cosmos3DistilledModularPipeline(
        blocks=Cosmos3DistilledBlocks(), modular_config_dict={"distilled_sigmas": list(schedule.sigmas)}
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=schedule.shift, stochastic_sampling=schedule.stochastic)
    pipe.update_components(transformer=stack.ref, vae=assets.vae, text_tokenizer=assets.hf_tokenizer,
                           scheduler=scheduler)
    pipe.disable_safety_checker()
    pipe.set_progress_bar_config(disable=True)
    return pipe


IMAGE = picture(40, 70, 0)  # scaled to cover 32x48 and centre-cropped
VIDEO = [picture(40, 56, 10 + i) for i in range(7)]

# case -> (request options, schedule). Options vary so that each reference switch is crossed once.
CASES: dict[str, tuple[dict[str, Any], DistilledSchedule]] = {
    "text2video": ({"num_frames": 5, "use_system_prompt": False}, DistilledSchedule(SIGMAS)),
    "image2video": ({"num_frames": 5, "image": IMAGE, "use_resolution_template": False, "fps": 30.0},
                    DistilledSchedule(SIGMAS)),
    "text2image": ({"num_frames": 1}, DistilledSchedule(SIGMAS)),
    "video2video": ({"num_frames": 9, "video": VIDEO, "condition_latent_frames": (0, 2),
                     "condition_video_keep": "last", "use_duration_template": False}, DistilledSchedule(SIGMAS)),
    # Scheduler variants: shift != 1 (2 steps), and plain Euler (no re-noising: no draws at all).
    "text2video_shift3": ({"num_frames": 5}, DistilledSchedule((1.0, 0.5), shift=3.0)),
    "image2video_euler": ({"num_frames": 5, "image": IMAGE}, DistilledSchedule(SIGMAS, stochastic=False)),
}
BOTH_FLAVOURS = ("text2video", "image2video")

_REFERENCE_NAMES = {
    "condition_latent_frames": "condition_frame_indexes_vision",
    "use_resolution_template": "add_resolution_template",
    "use_duration_template": "add_duration_template",
}


def reference_run(pipe: Cosmos3DistilledModularPipeline, seed: int, **kw: Any) -> tuple[torch.Tensor, Any, Any]:
    """(final latents, decoded frames float [T, H, W, 3] in [0, 1], the generator after the call)."""
    kw = {_REFERENCE_NAMES.get(k, k): v for k, v in kw.items()}
    gen = torch.Generator().manual_seed(seed)
    state = pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, generator=gen, output_type="np", **kw)
    return state.get("latents"), state.get("videos"), gen


def our_run(stack: Stack, assets: TinyAssets, seed: int, schedule: DistilledSchedule, *, decode: bool = False,
            **kw: Any) -> tuple[WorldResult, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    res = run_world_distilled(stack.ours, assets.encoder, assets.tokenizer, prompt=PROMPT, schedule=schedule,
                              height=HEIGHT, width=WIDTH, generator=gen, decode=decode, **kw)
    return res, gen


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> float:
    assert ours.dtype == torch.float32, what
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: {tuple(ours.shape)} != {tuple(ref.shape)}"
    scale = ref.float().abs().max().item()
    err = (ours - ref.float()).abs().max().item()
    assert scale > 0, what
    assert err <= tol * scale, f"{what}: max abs diff {err:.3e} > {tol} * {scale:.3e}"
    return err / scale


CASE_IDS = [(case, flavour) for case in CASES for flavour in (FLAVOURS if case in BOTH_FLAVOURS else FLAVOURS[:1])]


@pytest.mark.parity
@pytest.mark.parametrize(("case", "flavour"), CASE_IDS, ids=[f"{c}-{f}" for c, f in CASE_IDS])
def test_distilled_world_matches_diffusers(stacks, assets, case: str, flavour: str) -> None:
    kw, schedule = CASES[case]
    stack = stacks(flavour)
    seed = 10 * list(CASES).index(case) + FLAVOURS.index(flavour)
    ref_latents, ref_video, ref_gen = reference_run(reference_pipeline(stack, assets, schedule), seed, **kw)
    ours, our_gen = our_run(stack, assets, seed, schedule, **kw)

    assert_close(ours.video_latents, ref_latents, LATENT_REL_TOL, "video latents")
    pixels = decode_pixels(assets.encoder, ours.video_latents)  # [T, H, W, 3] in [0, 1]
    assert pixels.shape == (kw["num_frames"], HEIGHT, WIDTH, 3)
    assert_close(pixels, torch.from_numpy(ref_video), PIXEL_REL_TOL, "decoded frames")
    ref_u8 = (ref_video * 255).round().astype(np.uint8)
    diff = np.abs(pixels_to_uint8(pixels).numpy().astype(int) - ref_u8.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2
    # Same draws in the same order (initial noise, then one per step when re-noising).
    assert torch.equal(our_gen.get_state(), ref_gen.get_state())
    assert ours.sound_latents is None and ours.sound is None


def test_conditioned_frames_stay_clean(stacks, assets) -> None:
    """Every step re-noises all positions; the conditioned latent frames must come out as encoded."""
    kw, schedule = CASES["video2video"]
    res, _ = our_run(stacks("tiny-qwen"), assets, 5, schedule, **kw)
    req = world_request(prompt=PROMPT, height=HEIGHT, width=WIDTH, **kw)
    clean = assets.encoder.encode(req.conditioning_clip())  # [1, C, 3, h, w]
    assert torch.equal(res.video_latents[:, :, [0, 2]], clean[:, :, [0, 2]].float())


def test_decode_returns_uint8_frames_and_reports_steps(stacks, assets) -> None:
    kw, schedule = CASES["image2video"]
    calls: list[tuple[int, int]] = []
    res, _ = our_run(stacks("tiny-qwen"), assets, 3, schedule, decode=True,
                     on_step=lambda i, n: calls.append((i, n)), **kw)
    assert calls == [(i, len(SIGMAS)) for i in range(len(SIGMAS))]
    assert res.frames is not None and res.frames.dtype == torch.uint8
    assert tuple(res.frames.shape) == (5, HEIGHT, WIDTH, 3)
    assert torch.equal(res.frames, pixels_to_uint8(decode_pixels(assets.encoder, res.video_latents)))
    for stage in ("tokenize", "preprocess", "vae_encode", "step_noise", "reasoner_prefill", "denoise_step3",
                  "denoise", "vae_decode", "total"):
        assert stage in res.timings_ms, stage


def test_sound_is_refused(stacks, assets) -> None:
    """The distilled pipeline has no sound branch, even on a transformer with sound heads."""
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(RequestError) as e:
        run_world_distilled(stacks("tiny-qwen").ours, assets.encoder, assets.tokenizer, prompt=PROMPT,
                            schedule=DistilledSchedule(SIGMAS), num_frames=5, height=HEIGHT, width=WIDTH,
                            enable_sound=True, generator=gen)
    assert e.value.field == "enable_sound"
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # nothing drawn
    with pytest.raises(RequestError) as e:  # request fields are validated as in run_world
        run_world_distilled(stacks("tiny-qwen").ours, assets.encoder, assets.tokenizer, prompt=PROMPT,
                            schedule=DistilledSchedule(SIGMAS), num_frames=6, height=HEIGHT, width=WIDTH)
    assert e.value.field == "num_frames"
    with pytest.raises(TypeError):
        run_world_distilled(stacks("tiny-qwen").ours, assets.encoder, assets.tokenizer, prompt=PROMPT,
                            schedule=list(SIGMAS), num_frames=5, height=HEIGHT, width=WIDTH)  # type: ignore[arg-type]


def write_checkpoint_configs(folder, sigmas: Any, scheduler: dict[str, Any]) -> None:
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "Cosmos3DistilledModularPipeline", "_blocks_class_name": "Cosmos3DistilledBlocks"}
    if sigmas is not None:
        index["distilled_sigmas"] = sigmas
    (folder / "modular_model_index.json").write_text(json.dumps(index))
    sched = {"_class_name": "FlowMatchEulerDiscreteScheduler", **scheduler}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched))


@pytest.mark.parity
@pytest.mark.parametrize("scheduler", [{"shift": 1.0, "stochastic_sampling": True}, {"shift": 2.5}, {}])
def test_schedule_is_read_like_diffusers(tmp_path, scheduler: dict[str, Any]) -> None:
    sigmas = [1.0, 0.9, 0.6, 0.3]
    write_checkpoint_configs(tmp_path, sigmas, scheduler)
    ours = load_distilled_schedule(tmp_path)
    pipe = Cosmos3DistilledModularPipeline(blocks=Cosmos3DistilledBlocks(), pretrained_model_name_or_path=tmp_path)
    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert list(ours.sigmas) == [float(s) for s in pipe.config.distilled_sigmas]
    assert (ours.shift, ours.stochastic) == (ref.config.shift, ref.config.stochastic_sampling)
    assert ours.num_train_timesteps == ref.config.num_train_timesteps


@pytest.mark.parametrize(
    ("sigmas", "scheduler"),
    [(None, {}), ([], {}), ([1.0, 1.0], {}), ([1.0], {"use_karras_sigmas": True}),
     ([1.0], {"use_dynamic_shifting": True}), ([1.0], {"shift_terminal": 0.1}),
     ([1.0], {"_class_name": "UniPCMultistepScheduler"})],
)
def test_schedule_errors(tmp_path, sigmas: Any, scheduler: dict[str, Any]) -> None:
    write_checkpoint_configs(tmp_path, sigmas, scheduler)
    with pytest.raises(DistilledCheckpointError):
        load_distilled_schedule(tmp_path)
    with pytest.raises(DistilledCheckpointError):
        load_distilled_schedule(tmp_path / "missing")
