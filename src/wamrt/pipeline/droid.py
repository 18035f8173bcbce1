"""The DROID policy contract of NVIDIA's released Policy-DROID checkpoints (framework server path).

Observation (openpi keys) -> 540x640 canvas -> reflect pad to the tier-480 bucket -> frame-0 VAE
latent -> [text | 9 latent frames | 33 action rows (clean state row + 32 noisy)] -> 4-step UniPC with
CFG -> [32, 8] float32 joint-position chunk (gripper flipped in and out). See
../shared/docs/droid_contract.md for every rule reproduced here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import torch

from ..model import (
    Cosmos3Config,
    Cosmos3Transformer,
    action_positions,
    generator_offset,
    text_positions,
    vision_positions,
)
from .canvas import PaddedCanvas, compose_droid_canvas, pad_to_bucket, pad_unit_pixels
from .denoise import Branch, DenoiseInputs, DenoiseResult, SamplingOptions, denoise
from .errors import RequestError
from .noise import GaussianPrefetcher, initial_action, state_row_from_observation, vision_noise
from .normalization import ActionNormalization
from .observation import PROMPT, check_observation
from .prefix import (
    MAX_PREFIX_ROWS,
    PREFIX_MODE_KEY,
    ActionPrefix,
    model_space_prefix,
    parse_action_prefix,
    prefix_anchor,
    prefix_metadata,
)
from .prompts import droid_prompt
from .tokens import CaptionTokenizer
from .vae import FrameEncoder, unit_pixels

PromptFormat = Literal["plain", "json"]


@dataclass(frozen=True)
class DroidContract:
    """Fixed facts of the released DROID policy recipe (defaults = NVIDIA's server)."""

    prompt_format: PromptFormat = "plain"  # Nano: plain text (unconfirmed on real files); Edge: json
    chunk: int = 32
    fps: float = 15.0
    tier: str = "480"
    domain_id: int = 8  # droid_lerobot
    raw_action_dim: int = 8  # 7 joint positions + gripper
    history: int = 1  # clean state rows before the predicted chunk
    # None (the released checkpoints): raw state row in, raw joint targets out. A checkpoint trained here
    # may store statistics (wamrt.json "action_normalization"; see wamrt.pipeline.normalization).
    normalization: ActionNormalization | None = None
    # wamrt.json "trained_with_action_prefix": trained with random clean prefixes, so a request's `action_prefix`
    # is read as clean rows by default (else inpainted; see wamrt.pipeline.prefix).
    trained_with_action_prefix: bool = False


@dataclass
class PreparedDroid:
    """Everything the denoising loop needs for one request, plus what produced it."""

    inputs: DenoiseInputs
    prompt: str
    seed: int
    canvas: np.ndarray  # [540, 640, 3] uint8 (pixel frame 0 before padding)
    image_size: tuple[int, int, int, int]  # canvas h, w, content h, w
    timings_ms: dict[str, float] = field(default_factory=dict)
    state: np.ndarray | None = None  # [raw_dim] the raw model-space state row (what relative actions add to)
    prefix_rows: int = 0  # d: the committed rows the request carried (`action_prefix`)
    prefix_mode: str | None = None  # how they conditioned the chunk: "clean" or "inpaint"
    notes: list[str] = field(default_factory=list)  # what the observation check filled in or ignored


@dataclass
class ActionChunk:
    """The reply to one observation (`Policy.infer`).

    actions: float32 [chunk, raw_action_dim] = [32, 8]: columns 0..6 absolute joint targets in radians, column 7
        the gripper in the client's convention (0 open, 1 closed).
    seed: the noise seed the request ran with (pass it back to reproduce the chunk).
    prompt: the caption the model read (the instruction in the checkpoint's prompt format).
    timings_ms: stage durations (preprocess, vae_encode, tokenize, reasoner_prefill, denoise_step<i>, ...,
        total).
    notes: what the observation check filled in or ignored (a zero-filled optional view, an unknown key), as
        the server's `metadata.notes` says it.
    """

    actions: np.ndarray  # [chunk, raw_action_dim] float32
    seed: int
    prompt: str
    timings_ms: dict[str, float]
    prefix_rows: int = 0  # the request's committed rows, which rows 0..d-1 repeat (wamrt.pipeline.prefix)
    prefix_mode: str | None = None
    notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        total = self.timings_ms.get("total", float("nan"))
        return f"ActionChunk(shape={self.actions.shape}, seed={self.seed}, total={total:.1f} ms)"


@dataclass
class DroidHostInputs:
    """The host-side part of one request (validation, state row, canvas): no model, no device. A server
    builds these for a whole batch in parallel threads, then encodes the batch's canvases in one VAE call."""

    instruction: str
    state: np.ndarray
    canvas: np.ndarray  # [540, 640, 3] uint8
    padded: PaddedCanvas
    timings_ms: dict[str, float]
    prefix: ActionPrefix | None = None  # the committed rows (`action_prefix`), robot space
    notes: list[str] = field(default_factory=list)


def droid_host_inputs(obs: Mapping[str, Any], contract: DroidContract) -> DroidHostInputs:
    """Validate one observation (`check_observation`: the contract every server surface runs too) and build its
    padded canvas; raises RequestError naming the field."""
    t0 = time.perf_counter()
    checked = check_observation(obs)
    obs = checked.observation
    state = state_row_from_observation(obs)
    canvas = compose_droid_canvas(obs)  # [540, 640, 3] uint8
    padded = pad_to_bucket(canvas, contract.tier)
    prefix = parse_action_prefix(obs, raw_dim=contract.raw_action_dim,
                                 max_rows=min(MAX_PREFIX_ROWS, contract.chunk - 1))
    return DroidHostInputs(obs[PROMPT], state, canvas, padded, {"preprocess": 1e3 * (time.perf_counter() - t0)},
                           prefix, checked.notes)


def encode_canvases(encoder: FrameEncoder, padded: list[PaddedCanvas], device: torch.device,
                    encode_frames: int = 1, *, pad_on_device: bool = True) -> list[torch.Tensor]:
    """Frame-0 latents [1, C, 1, lat_h, lat_w] of padded canvases: one VAE call per distinct canvas geometry
    (a server batch shares its tier, so usually one call for the whole batch).

    What travels to the device is each canvas's content, before its bucket pad (`encode_content_uint8` pads there;
    the engine's encoder inside its CUDA graph); to a GPU from pinned memory, without the host waiting for it.
    pad_on_device=False: the padded canvases, from pageable memory (the comparison path).

    encode_frames > 1 encodes the canvas repeated that many times, as diffusers does, and keeps latent
    frame 0 (identical under the causal VAE; only benchmarks the reference's cost)."""
    out: list[torch.Tensor | None] = [None] * len(padded)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(padded):
        groups.setdefault((p.content.shape, p.geometry), []).append(i)
    for (shape, geometry), idx in groups.items():
        if pad_on_device:
            content = _to_device(shape, [padded[i].content for i in idx], device)  # [B, content_h, content_w, 3]
        else:
            frames = torch.from_numpy(np.stack([padded[i].pixels for i in idx])).to(device)  # [B, H, W, 3]
        if encode_frames == 1:  # [B, C, 1, H/16, W/16] fp32
            latents = encoder.encode_content_uint8(content, geometry) if pad_on_device else encoder.encode_uint8(frames)
        else:
            pixels = pad_unit_pixels(unit_pixels(content), geometry) if pad_on_device else unit_pixels(frames)
            latents = encoder.encode(pixels[:, :, None].expand(-1, -1, encode_frames, -1, -1))[:, :, :1]
        for j, i in enumerate(idx):
            _, _, content_h, content_w = padded[i].image_size
            lat_h, lat_w = max(content_h // encoder.spatial, 1), max(content_w // encoder.spatial, 1)
            out[i] = latents[j : j + 1, ..., :lat_h, :lat_w]
    return out  # type: ignore[return-value]


def _to_device(shape: tuple[int, ...], arrays: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Equal-shape uint8 arrays stacked into one tensor on `device`. To a GPU through a pinned buffer (PyTorch's
    caching host allocator keeps it until the copy is done): a pageable copy blocks the host until it lands."""
    if device.type != "cuda":
        return torch.from_numpy(np.stack(arrays)).to(device)
    staged = torch.empty((len(arrays), *shape), dtype=torch.uint8, pin_memory=True)
    view = staged.numpy()
    for j, a in enumerate(arrays):
        view[j] = a
    return staged.to(device, non_blocking=True)


def finish_droid(
    host: DroidHostInputs,
    latent0: torch.Tensor,
    *,
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer,
    contract: DroidContract,
    seed: int,
    device: torch.device,
    noise: GaussianPrefetcher | None = None,
    latent_ready: Callable[[], None] | None = None,
    max_prompt_tokens: int = 0,
    guided_prefix: bool = True,
) -> PreparedDroid:
    """Prompt, tokens, noise and positions of one request around its frame-0 latent. `latent_ready`, if given, is
    called just before latent0 is first read on the current stream (after every host-to-device copy here): an
    engine that encodes on a side stream makes the current stream wait for it there, so the copies above -- from
    pageable memory, which waits for the stream's queued work -- do not wait for the encode. `max_prompt_tokens`
    (> 0): a caption of more tokens is a RequestError naming `prompt`, before any device work of its own.
    `guided_prefix` False (the engine: no backward pass in its graphs): a "guided" prefix is a RequestError."""
    timings = dict(host.timings_ms)
    canvas_h, canvas_w, _, _ = host.padded.image_size
    lat_h, lat_w = latent0.shape[-2:]
    t0 = time.perf_counter()
    prompt = droid_prompt(host.instruction, json_format=contract.prompt_format == "json",
                          canvas_hw=(canvas_h, canvas_w))
    cond_ids = tokenizer.encode(prompt).text_ids
    if max_prompt_tokens and len(cond_ids) > max_prompt_tokens:
        raise RequestError(f"{len(cond_ids)} tokens with the caption around the instruction, over this server's "
                           f"{max_prompt_tokens} (wamrt serve --max-prompt-tokens counts the instruction's)",
                           field="prompt")
    uncond_ids = tokenizer.encode("").text_ids
    timings["tokenize"] = 1e3 * (time.perf_counter() - t0)

    t0 = time.perf_counter()
    frames = contract.chunk + 1
    lat_t = (frames - 1) // encoder.temporal + 1
    shape = (1, encoder.latent_channels, lat_t, lat_h, lat_w)
    stream = noise.get(seed, shape) if noise is not None else vision_noise(seed, shape)
    rows = contract.chunk + contract.history
    state = host.state
    model_state = contract.normalization.state_in(state) if contract.normalization is not None else state
    act = initial_action(model_state, seed, rows=rows, max_action_dim=model.config.action_dim or 0, stream=stream)
    init = act.init
    action_noisy, anchor, mode = droid_action_noisy(contract, device), None, None
    if host.prefix is not None:  # the committed rows: clean rows after the state row, or inpainted ones
        mode = host.prefix.resolve(contract.trained_with_action_prefix)
        if mode == "guided" and not guided_prefix:
            raise RequestError("'guided' needs a backward pass a step, which only the eager reference runs "
                               "(load_policy(...).infer); use 'inpaint' or 'clean' here", field=PREFIX_MODE_KEY)
        rows_model = model_space_prefix(host.prefix.rows, state, contract.normalization)
        anchor = prefix_anchor(rows_model, init, history=contract.history, mode=mode, device=device)
        if mode == "clean":  # clean rows hold their value from the start, as in training (wamrt.train)
            action_noisy = _action_noisy(rows, contract.history + len(rows_model), device)
            init = init.copy()
            init[contract.history:contract.history + len(rows_model), :contract.raw_action_dim] = rows_model
    vision = torch.from_numpy(stream).to(device, copy=True)  # copy: frame 0 is overwritten below
    action = torch.from_numpy(init).to(device)[None]  # [1, 33, 64]

    inputs = DenoiseInputs(
        cond=droid_branch(model.config, cond_ids, (lat_t, lat_h, lat_w), contract, device),
        uncond=droid_branch(model.config, uncond_ids, (lat_t, lat_h, lat_w), contract, device), vision=vision,
        vision_noisy=droid_vision_noisy(lat_t, device),
        action=action, action_noisy=action_noisy,
        domain_ids=_domain_ids(contract.domain_id, device), raw_action_dim=contract.raw_action_dim,
        action_anchor=anchor,
    )
    if latent_ready is not None:
        latent_ready()
    vision[:, :, :1] = latent0
    timings["pack"] = 1e3 * (time.perf_counter() - t0)
    return PreparedDroid(inputs, prompt, seed, host.canvas, host.padded.image_size, timings, state,
                         0 if host.prefix is None else len(host.prefix.rows), mode, host.notes)


def prepare_droid(
    obs: Mapping[str, Any],
    *,
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer,
    contract: DroidContract,
    seed: int,
    device: torch.device,
    encode_frames: int = 1,
    noise: GaussianPrefetcher | None = None,
) -> PreparedDroid:
    """Build the static inputs of one DROID request (canvas, latent, prompt, tokens, noise, positions):
    `droid_host_inputs`, `encode_canvases` and `finish_droid` for a single observation."""
    host = droid_host_inputs(obs, contract)
    t0 = time.perf_counter()
    latent0 = encode_canvases(encoder, [host.padded], device, encode_frames)[0]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # not the device: see pipeline.denoise._sync
    host.timings_ms["vae_encode"] = 1e3 * (time.perf_counter() - t0)
    return finish_droid(host, latent0, model=model, encoder=encoder, tokenizer=tokenizer, contract=contract,
                        seed=seed, device=device, noise=noise)


def droid_branch(cfg: Cosmos3Config, ids: tuple[int, ...], latent_thw: tuple[int, int, int],
                 contract: DroidContract, device: torch.device | str = "cpu") -> Branch:
    """One CFG branch of a DROID request: its token ids and the positions of the packed sequence
    [text | lat_t x ph x pw vision patches | history + chunk action rows]. Shared by inference
    (`prepare_droid`) and training (`wamrt.train`), so both pack the same way. The positions tensor is shared by
    every branch of the same layout (cached; never write into it)."""
    layout = ("droid", len(ids), tuple(latent_thw), contract.chunk + contract.history, float(contract.fps))
    positions = _droid_positions(cfg, layout, str(torch.device(device)))
    return Branch(torch.tensor([ids], dtype=torch.long, device=device), positions, layout, tuple(ids))


# Requests of one robot share their geometry and usually their instruction length: the positions (a few hundred
# microseconds of CPU work and a host-to-device copy per branch) are made once per layout. Every cached tensor is
# made outside inference mode (a normal tensor), whichever mode the first caller ran in: inference reads it as it
# reads weights, and training may save it for backward (an inference tensor there raises).
@lru_cache(maxsize=256)
@torch.inference_mode(False)
def _droid_positions(cfg: Cosmos3Config, layout: tuple, device: str) -> torch.Tensor:
    _, n_text, (lat_t, lat_h, lat_w), rows, fps = layout
    ph, pw = -(-lat_h // cfg.latent_patch_size), -(-lat_w // cfg.latent_patch_size)
    off = generator_offset(cfg, n_text)
    pos = torch.cat([text_positions(n_text), vision_positions(cfg, lat_t, ph, pw, off, fps),
                     action_positions(cfg, rows, off, fps, start_frame=0)], dim=1)
    return pos[None].to(device)


OBSERVED_LATENT_FRAMES = 1  # the observation's latent frames, at the front of the clip: clean, never denoised


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def droid_vision_noisy(lat_t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, lat_t] bool: latent frame 0 (the observation) is clean, the future frames are generated (cached: never
    write into it)."""
    return (torch.arange(lat_t, device=device) >= OBSERVED_LATENT_FRAMES)[None]


def droid_action_noisy(contract: DroidContract, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, history + chunk] bool: the state row(s) are clean, the chunk rows are generated (cached: never write
    into it)."""
    return _action_noisy(contract.chunk + contract.history, contract.history, device)


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def _action_noisy(rows: int, history: int, device: torch.device | str) -> torch.Tensor:
    return (torch.arange(rows, device=device) >= history)[None]


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def _domain_ids(domain_id: int, device: torch.device | str) -> torch.Tensor:
    return torch.tensor([domain_id], device=device)


def droid_metadata(name: str, contract: DroidContract, options: SamplingOptions, *,
                   guided_prefix: bool = True) -> dict[str, Any]:
    """What a client needs to know before sending observations (openpi-style handshake); `guided_prefix` False
    for the engine, which refuses "guided" prefixes."""
    return {
        "model": name, "contract": "droid", "action_horizon": contract.chunk,
        "action_dim": contract.raw_action_dim, "control_hz": contract.fps, "image_size": [540, 640],
        "prompt_format": contract.prompt_format, "domain_id": contract.domain_id, "num_steps": options.steps,
        "guidance": options.guidance, "shift": options.shift, "guidance_interval": options.guidance_interval,
        "action_normalization": None if contract.normalization is None else
        ("per-row statistics, joints relative to the state" if any(contract.normalization.relative)
         else "per-row statistics"),
        "action_prefix": prefix_metadata(contract.trained_with_action_prefix, guided=guided_prefix),
    }


def droid_actions(result: DenoiseResult, contract: DroidContract, state: np.ndarray | None = None) -> np.ndarray:
    """Final action state [1, 33, 64] -> [32, 8] float32: drop the state row, undo the checkpoint's
    normalization if it has one (`state`: the request's raw state row), flip the gripper back."""
    assert result.action is not None
    out = result.action[0, contract.history:, : contract.raw_action_dim].float().cpu().numpy().copy()
    if contract.normalization is not None:
        if state is None:
            raise ValueError("a normalized contract needs the request's state row to undo the normalization")
        out = contract.normalization.actions_out(out, state)
    out[:, -1] = 1.0 - out[:, -1]
    return out


def run_droid(
    obs: Mapping[str, Any],
    *,
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer,
    contract: DroidContract,
    options: SamplingOptions,
    seed: int,
    record: bool = False,
) -> tuple[ActionChunk, PreparedDroid, DenoiseResult]:
    """One request through the eager reference path."""
    device = next(model.parameters()).device
    t_start = time.perf_counter()
    prep = prepare_droid(obs, model=model, encoder=encoder, tokenizer=tokenizer, contract=contract,
                         seed=seed, device=device)
    # A guided prefix differentiates through the model: inference tensors cannot be saved for backward.
    with torch.no_grad() if prep.prefix_mode == "guided" else torch.inference_mode():
        result = denoise(model, prep.inputs, options, record=record)
    t0 = time.perf_counter()
    actions = droid_actions(result, contract, prep.state)
    timings = {**prep.timings_ms, **result.timings_ms, "postprocess": 1e3 * (time.perf_counter() - t0)}
    timings["total"] = 1e3 * (time.perf_counter() - t_start)
    return ActionChunk(actions, seed, prep.prompt, timings, prep.prefix_rows, prep.prefix_mode,
                       list(prep.notes)), prep, result
