"""Generic action task contracts as diffusers 0.42.1 defines them (`Cosmos3OmniPipeline` + action).

* policy: image -> actions + future video latents (vision frame 0 and nothing else is clean);
* forward_dynamics: image + raw actions -> future video latents (frame 0 and every action row clean);
* inverse_dynamics: video -> actions (every vision frame clean, every action row noisy).

What differs from the reference on purpose (results are the same):
* policy / forward dynamics encode pixel frame 0 only. The reference encodes the image repeated
  chunk + 1 times and then replaces every latent frame but 0 with noise; Wan2.2 is causal in time,
  so latent frame 0 only ever saw pixel frame 0.
* the Reasoner runs once per CFG branch (K/V reused by every step), see `denoise`.
* a uint8 numpy image goes through PIL (the reference's numpy path skips the /255 scaling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from ..model import Cosmos3Config, Cosmos3Transformer
from .canvas import diffusers_preprocess_image
from .denoise import DenoiseInputs, denoise
from .domains import Domain, resolve_domain
from .errors import RequestError
from .geometry import (
    DIFFUSERS_ACTION_RESOLUTION_BINS,
    VAE_SPATIAL,
    CanvasGeometry,
    LatentGeometry,
    canvas_geometry,
    latent_geometry,
)
from .inputs import ImageInput, VideoInput, finite_number, positive_int, rgb_frames, rgb_image, text_field
from .omni import (
    check_vae,
    decode_frames,
    diffusers_sampling,
    draw_noise,
    model_device,
    packed_branch,
    tokenize_branches,
)
from .prompts import DIFFUSERS_VIEWPOINT_TEMPLATES, diffusers_action_json_prompt, diffusers_system_prompt
from .tokens import CaptionTokenizer
from .vae import FrameEncoder

Mode = Literal["policy", "forward_dynamics", "inverse_dynamics"]
MODES: tuple[str, ...] = ("policy", "forward_dynamics", "inverse_dynamics")
TIERS: tuple[int, ...] = tuple(int(k) for k in DIFFUSERS_ACTION_RESOLUTION_BINS)  # 256, 480, 704, 720
VIEW_POINTS: tuple[str, ...] = tuple(DIFFUSERS_VIEWPOINT_TEMPLATES)


# ------------------------------------------------------------------------------------------------
# Input validation


def _conditioning_frames(mode: str, image: Any, video: Any) -> tuple[Image.Image, ...]:
    if image is not None and video is not None:
        raise RequestError("give either image or video, not both", field="image")
    if mode == "inverse_dynamics" and video is None:
        raise RequestError(
            "inverse_dynamics needs a video (its frames are the clean conditioning)", field="video"
        )
    if image is None and video is None:
        raise RequestError(f"{mode} needs an image (or a video whose first frame is used)", field="image")
    if image is not None:
        return (rgb_image(image, "image"),)
    frames = rgb_frames(video, "video")
    # The reference resizes every frame to frame 0's size; mixed sizes are refused instead of guessed at.
    if any(f.size != frames[0].size for f in frames):
        raise RequestError(f"frames differ in size: {sorted({f.size for f in frames})}", field="video")
    return frames


def _raw_actions(raw: Any, domain: Domain, chunk: int) -> torch.Tensor:
    """raw actions [T, raw_dim] -> float32 [chunk, raw_dim]: short inputs repeat their last row."""
    if isinstance(raw, np.ndarray):
        if raw.dtype.kind not in "iuf":
            raise RequestError(f"must be numeric, got dtype {raw.dtype}", field="raw_actions")
        raw = torch.from_numpy(np.array(raw))
    if not isinstance(raw, torch.Tensor):
        raise RequestError(
            f"must be a tensor or array [T, {domain.raw_action_dim}], got {type(raw).__name__}",
            field="raw_actions",
        )
    if raw.is_complex() or raw.dtype == torch.bool:
        raise RequestError(f"must be real-valued, got {raw.dtype}", field="raw_actions")
    if raw.ndim != 2 or raw.shape[0] < 1:
        raise RequestError(f"must have shape [T >= 1, D], got {tuple(raw.shape)}", field="raw_actions")
    if raw.shape[1] != domain.raw_action_dim:
        raise RequestError(
            f"width {raw.shape[1]} != {domain.raw_action_dim}, the action width of domain {domain.name!r}",
            field="raw_actions",
        )
    # Cast first (as the reference does), so a float64 value that overflows float32 is caught too.
    x = raw.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise RequestError("contains NaN or inf", field="raw_actions")
    if x.shape[0] < chunk:
        x = torch.cat([x, x[-1:].expand(chunk - x.shape[0], -1)])
    return x[:chunk].contiguous()


def _check_model(cfg: Cosmos3Config, encoder: FrameEncoder, domain: Domain) -> None:
    if not cfg.action_gen or cfg.action_dim is None:
        raise RequestError("the transformer was not built with action_gen=True", field="model")
    if domain.raw_action_dim > cfg.action_dim:
        raise RequestError(
            f"domain {domain.name!r} needs {domain.raw_action_dim} action columns but the model "
            f"has action_dim={cfg.action_dim}",
            field="domain",
        )
    if domain.domain_id >= cfg.num_embodiment_domains:
        raise RequestError(
            f"domain id {domain.domain_id} >= num_embodiment_domains={cfg.num_embodiment_domains}",
            field="domain",
        )
    check_vae(cfg, encoder)


# ------------------------------------------------------------------------------------------------
# Request -> loop inputs


@dataclass(frozen=True, eq=False)
class PreparedGeneric:
    """A request turned into the loop's inputs (noise already drawn)."""

    request: GenericRequest
    inputs: DenoiseInputs
    latent: LatentGeometry
    cond_ids: tuple[int, ...]
    uncond_ids: tuple[int, ...]
    timings_ms: dict[str, float]


@dataclass(frozen=True, eq=False)
class GenericRequest:
    """One validated generic action request; `prepare` turns it into `DenoiseInputs`."""

    mode: str
    domain: Domain
    chunk_size: int
    resolution_tier: int
    view_point: str | None  # None: no cinematography field in the caption
    fps: float
    prompt: str
    negative_prompt: str
    use_system_prompt: bool
    frames: tuple[Image.Image, ...]  # conditioning frames as given, RGB, one size
    raw_actions: torch.Tensor | None  # [chunk, raw_dim] float32 (forward dynamics only)
    canvas: CanvasGeometry  # where frame 0 (after the multiple-of-16 resize) lands on its bin canvas

    @property
    def num_frames(self) -> int:
        return self.chunk_size + 1  # actions are transitions between chunk + 1 frames

    @property
    def latent(self) -> LatentGeometry:
        return latent_geometry(self.num_frames, self.canvas.content_h, self.canvas.content_w)

    @property
    def clean_latent_frames(self) -> int:
        """Leading latent frames that are conditioning (and so must be encoded)."""
        return self.latent.latent_t if self.mode == "inverse_dynamics" else 1

    @property
    def system_prompt(self) -> str | None:
        return diffusers_system_prompt(self.num_frames) if self.use_system_prompt else None

    def captions(self) -> tuple[str, str]:
        """(cond, uncond): the JSON action caption, and the bare negative prompt (no JSON, no metadata)."""
        cond = diffusers_action_json_prompt(
            self.prompt,
            view_point=self.view_point,
            num_frames=self.num_frames,
            fps=self.fps,
            height=self.canvas.canvas_h,
            width=self.canvas.canvas_w,
        )
        return cond, self.negative_prompt

    def pixel_clip(self) -> torch.Tensor:
        """Frames the VAE must see -> float32 [1, 3, T, canvas_h, canvas_w]; T = 1 unless inverse dynamics."""
        n = 1 if self.clean_latent_frames == 1 else self.num_frames
        # Pad by repeating the last frame, or truncate, to the chunk + 1 frames of the clip.
        picked = [self.frames[min(i, len(self.frames) - 1)] for i in range(n)]
        cache: dict[int, torch.Tensor] = {}
        out = []
        for frame in picked:
            if id(frame) not in cache:
                prepped = diffusers_preprocess_image(frame, self.resolution_tier)
                assert prepped.geometry == self.canvas, (prepped.geometry, self.canvas)
                cache[id(frame)] = prepped.pixels  # [1, 3, H, W]
            out.append(cache[id(frame)])
        return torch.stack(out, dim=2)  # [1, 3, n, H, W]

    def prepare(
        self,
        cfg: Cosmos3Config,
        encoder: FrameEncoder,
        tokenizer: CaptionTokenizer,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> PreparedGeneric:
        """Encode the conditioning, tokenize both branches, draw the noise as the reference does."""
        _check_model(cfg, encoder, self.domain)
        assert cfg.action_dim is not None
        device = torch.device(device)
        timings: dict[str, float] = {}
        lat, chunk, n_clean = self.latent, self.chunk_size, self.clean_latent_frames

        t0 = time.perf_counter()
        clip = self.pixel_clip()
        timings["preprocess"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        # The padded canvas is encoded, then cropped to the content (the model never sees the padding).
        x0 = encoder.encode(clip)[..., : lat.latent_h, : lat.latent_w].to(device)  # [1, C, n_clean, h, w]
        timings["vae_encode"] = 1e3 * (time.perf_counter() - t0)
        assert x0.shape[2] == n_clean, (x0.shape, n_clean)

        t0 = time.perf_counter()
        cond_ids, uncond_ids = tokenize_branches(tokenizer, cfg, *self.captions(), self.system_prompt)
        timings["tokenize"] = 1e3 * (time.perf_counter() - t0)

        # One generator, vision first, then action, each drawn whole even where it is overwritten
        # (all-clean vision in inverse dynamics, all-clean actions in forward dynamics), so every draw
        # lands on the same generator state as in the reference.
        vision_shape = (1, cfg.latent_channel, lat.latent_t, lat.latent_h, lat.latent_w)
        vision = draw_noise(vision_shape, generator, device)
        action_noise = draw_noise((chunk, cfg.action_dim), generator, device)
        vision[:, :, :n_clean] = x0
        vision_noisy = torch.arange(lat.latent_t, device=device)[None] >= n_clean  # [1, T]

        raw_dim = self.domain.raw_action_dim
        real_cols = torch.arange(cfg.action_dim, device=device) < raw_dim
        if self.mode == "forward_dynamics":
            assert self.raw_actions is not None
            action = torch.zeros(chunk, cfg.action_dim, device=device)
            action[:, :raw_dim] = self.raw_actions.to(device)
            action_noisy = torch.zeros(1, chunk, dtype=torch.bool, device=device)
        else:
            action = torch.where(real_cols, action_noise, torch.zeros_like(action_noise))
            action_noisy = torch.ones(1, chunk, dtype=torch.bool, device=device)

        inputs = DenoiseInputs(
            cond=packed_branch(cfg, cond_ids, lat, self.fps, device, action_rows=chunk),
            uncond=packed_branch(cfg, uncond_ids, lat, self.fps, device, action_rows=chunk),
            vision=vision,
            vision_noisy=vision_noisy,
            action=action[None],
            action_noisy=action_noisy,
            domain_ids=torch.tensor([self.domain.domain_id], device=device),
            raw_action_dim=raw_dim,
        )
        return PreparedGeneric(self, inputs, lat, tuple(cond_ids), tuple(uncond_ids), timings)


def generic_request(
    *,
    mode: str,
    prompt: str,
    domain: str,
    chunk_size: int,
    image: ImageInput | None = None,
    video: VideoInput | None = None,
    raw_actions: torch.Tensor | np.ndarray | None = None,
    resolution_tier: int | str = 480,
    view_point: str | None = "ego_view",
    fps: float = 24.0,
    negative_prompt: str | None = None,
    use_system_prompt: bool = False,
) -> GenericRequest:
    """Validate a generic request (RequestError on anything the reference would refuse or mis-handle)."""
    if mode not in MODES:
        raise RequestError(f"unknown mode {mode!r}; expected one of {list(MODES)}", field="mode")
    dom = resolve_domain(domain)
    chunk = positive_int(chunk_size, "chunk_size")
    if str(resolution_tier) not in DIFFUSERS_ACTION_RESOLUTION_BINS:
        raise RequestError(
            f"unknown tier {resolution_tier!r}; expected one of {list(TIERS)}", field="resolution_tier"
        )
    if view_point is not None and view_point not in DIFFUSERS_VIEWPOINT_TEMPLATES:
        # The reference drops the framing with a warning; a typo should not silently change the prompt.
        raise RequestError(
            f"unknown view point {view_point!r}; expected one of {list(VIEW_POINTS)} or None",
            field="view_point",
        )
    fps_f = finite_number(fps, "fps", positive=True)
    text_field(prompt, "prompt")
    text_field(negative_prompt, "negative_prompt", optional=True)
    frames = _conditioning_frames(mode, image, video)
    if mode == "forward_dynamics":
        if raw_actions is None:
            raise RequestError("forward_dynamics needs raw_actions [T, raw_dim]", field="raw_actions")
        actions = _raw_actions(raw_actions, dom, chunk)
    elif raw_actions is not None:
        # The reference ignores them here; refusing tells a caller that picked the wrong mode.
        raise RequestError(f"raw_actions only apply to forward_dynamics, not {mode}", field="raw_actions")
    else:
        actions = None
    w, h = frames[0].size
    h16, w16 = h - h % VAE_SPATIAL, w - w % VAE_SPATIAL  # the reference first floors to multiples of 16
    if h16 == 0 or w16 == 0:
        raise RequestError(
            f"must be at least 16x16, got {h}x{w}", field="image" if image is not None else "video"
        )
    canvas = canvas_geometry(h16, w16, str(resolution_tier), "diffusers")
    return GenericRequest(
        mode=mode,
        domain=dom,
        chunk_size=chunk,
        resolution_tier=int(resolution_tier),
        view_point=view_point,
        fps=fps_f,
        prompt=prompt,
        negative_prompt="" if negative_prompt is None else negative_prompt,
        use_system_prompt=bool(use_system_prompt),
        frames=frames,
        raw_actions=actions,
        canvas=canvas,
    )


# ------------------------------------------------------------------------------------------------
# Running


@dataclass
class GenericResult:
    actions: torch.Tensor | None  # [chunk, raw_dim] float32 on CPU, model space (policy, inverse dynamics)
    video_latents: torch.Tensor  # [1, C, T, H, W] float32, normalised, cropped to the content
    frames: torch.Tensor | None  # uint8 [4(T-1)+1, 16H, 16W, 3] when decoded (chunk + 1 if chunk % 4 == 0)
    timings_ms: dict[str, float] = field(default_factory=dict)


@torch.inference_mode()
def run_generic(
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer | Any,
    *,
    mode: str,
    prompt: str,
    domain: str,
    chunk_size: int,
    image: ImageInput | None = None,
    video: VideoInput | None = None,
    raw_actions: torch.Tensor | np.ndarray | None = None,
    resolution_tier: int | str = 480,
    view_point: str | None = "ego_view",
    fps: float = 24.0,
    negative_prompt: str | None = None,
    use_system_prompt: bool = False,
    steps: int = 4,
    guidance: float = 3.0,
    shift: float = 5.0,
    generator: torch.Generator | None = None,
    decode: bool = False,
) -> GenericResult:
    """One generic request end to end (the reference's `pipe(..., action=CosmosActionCondition(...))`)."""
    t_start = time.perf_counter()
    opts = diffusers_sampling(steps, guidance, shift)
    req = generic_request(
        mode=mode,
        prompt=prompt,
        domain=domain,
        chunk_size=chunk_size,
        image=image,
        video=video,
        raw_actions=raw_actions,
        resolution_tier=resolution_tier,
        view_point=view_point,
        fps=fps,
        negative_prompt=negative_prompt,
        use_system_prompt=use_system_prompt,
    )
    if not isinstance(tokenizer, CaptionTokenizer):
        tokenizer = CaptionTokenizer(tokenizer)
    prepared = req.prepare(model.config, encoder, tokenizer, generator=generator, device=model_device(model))
    out = denoise(model, prepared.inputs, opts)
    timings = {**prepared.timings_ms, **out.timings_ms}

    actions = None
    if mode != "forward_dynamics":  # there the actions were an input; the reference returns none either
        assert out.action is not None
        actions = out.action[0, :, : req.domain.raw_action_dim].float().cpu()
    frames = None
    if decode:
        t0 = time.perf_counter()
        frames = decode_frames(encoder, out.vision)
        timings["vae_decode"] = 1e3 * (time.perf_counter() - t0)
    timings["total"] = 1e3 * (time.perf_counter() - t_start)
    return GenericResult(actions, out.vision.float(), frames, timings)
