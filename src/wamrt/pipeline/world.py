"""World generation as diffusers 0.42.1 defines it (`Cosmos3OmniPipeline.__call__` without `action`).

* text -> image (num_frames = 1) and text -> video: every latent is noise;
* image -> video: latent frame 0 is the image, scaled to cover the output size and centre-cropped;
* video -> video: the latent frames listed in `condition_latent_frames` (diffusers'
  `condition_frame_indexes_vision`, default [0, 1]) are the video's first (or last,
  `condition_video_keep="last"`) 4 * max + 1 frames, each stretched to the output size;
and each of them optionally with sound: [sound_dim, T] latents, all noisy, denoised jointly with the
video and decoded by the checkpoint's sound tokenizer. Beyond diffusers (which has neither):
* video transfer (`controls`): the target generated beside clean control videos (`transfer.py`);
* long videos in chunks (`num_video_frames_per_chunk`): each later chunk conditioned on the last generated
  frames (`chunks.py`).

One CFG branch is packed as [text | vision | sound]. The caption is the prompt plus a duration/FPS
sentence (videos) and a resolution sentence; the negative prompt gets the negated sentences.

What differs from the reference on purpose (results are the same):
* only frames that become clean latents are encoded. The reference encodes the whole clip (a black one
  for text -> image/video) and then replaces every noisy latent frame with noise; Wan2.2 is causal in
  time, so latent frame k only ever saw pixel frames 0..4k.
* the Reasoner runs once per CFG branch (K/V reused by every step), see `denoise`.
* uint8 numpy video frames go through PIL like PIL frames (the reference's numpy path for `video`
  skips the /255 scaling).
* inputs the reference would silently ignore are refused: an image for a single frame, condition
  frames without a video; and frame counts the VAE cannot represent (not 4k + 1).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import torch
from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer
from PIL import Image

from ..model import Cosmos3Config, Cosmos3Transformer
from .canvas import diffusers_cover_crop, diffusers_resize_frame
from .chunks import ChunkPlan, chunk_plan, run_chunks
from .controls import SYSTEM_PROMPT_TRANSFER, control_directive
from .denoise import DenoiseInputs, DenoiseResult, denoise
from .errors import RequestError
from .geometry import VAE_SPATIAL, VAE_TEMPORAL, LatentGeometry, latent_geometry
from .inputs import ImageInput, VideoInput, bool_field, finite_number, positive_int, rgb_frames, rgb_image, text_field
from .omni import (
    check_vae,
    decode_pixels,
    diffusers_sampling,
    draw_noise,
    model_device,
    packed_branch,
    pixels_to_uint8,
    tokenize_branches,
)
from .prompts import diffusers_system_prompt, diffusers_world_caption
from .sound import SoundDecoder
from .tokens import CaptionTokenizer, as_caption_tokenizer
from .transfer import TransferSpec, encode_controls, transfer_spec
from .vae import FrameEncoder

WorldMode = Literal["text2image", "text2video", "image2video", "video2video"]
VIDEO_KEEP: tuple[str, ...] = ("first", "last")
# (model, inputs, options, on_step=...) -> result: `pipeline.denoise.denoise` or a faster equal.
Denoiser = Callable[..., DenoiseResult]
# (encoder, normalised latents, notes=list) -> float pixels [T, H, W, 3] in [0, 1], on the host or on the device
# (converted to uint8 there); appends to `notes` what the caller should know (`omni.decode_pixels`).
PixelDecoder = Callable[..., torch.Tensor]
DEFAULT_CONDITION_LATENT_FRAMES = (0, 1)  # diffusers' condition_frame_indexes_vision default


# ------------------------------------------------------------------------------------------------
# Request


@dataclass(frozen=True, eq=False)
class WorldRequest:
    """One validated world-generation request; build it with `world_request`."""

    prompt: str
    negative_prompt: str
    num_frames: int  # 4k + 1; 1 is an image
    height: int  # multiples of 16 (the VAE's spatial factor)
    width: int
    fps: float
    image: Image.Image | None  # image -> video conditioning frame, RGB
    video: tuple[Image.Image, ...] | None  # video -> video conditioning frames as given, RGB
    clean_latent_frames: tuple[int, ...]  # sorted; () for text -> image/video, (0,) for image -> video
    condition_video_keep: str  # "first" | "last": which end of the video conditions
    enable_sound: bool
    use_system_prompt: bool
    use_resolution_template: bool
    use_duration_template: bool
    transfer: TransferSpec | None = None  # video transfer: the controls and their guidance
    chunks: ChunkPlan | None = None  # a long video generated in chunks (None: in one go)

    @property
    def mode(self) -> WorldMode:
        if self.video is not None:
            return "video2video"
        if self.image is not None:
            return "image2video"
        return "text2image" if self.num_frames == 1 else "text2video"

    @property
    def latent(self) -> LatentGeometry:
        return latent_geometry(self.num_frames, self.height, self.width)

    @property
    def system_prompt(self) -> str | None:
        if not self.use_system_prompt:
            return None
        return SYSTEM_PROMPT_TRANSFER if self.transfer is not None else diffusers_system_prompt(self.num_frames)

    def captions(self) -> tuple[str, str]:
        """(cond, uncond): prompt and negative prompt, each with its (negated) metadata sentences."""
        common = dict(
            num_frames=self.num_frames, height=self.height, width=self.width, fps=self.fps,
            use_duration_template=self.use_duration_template,
            use_resolution_template=self.use_resolution_template,
        )
        cond = diffusers_world_caption(self.prompt, negative=False, **common)
        if self.transfer is not None and self.transfer.emphasize:
            cond = f"{cond.rstrip()} {control_directive(self.transfer.keys)}"
        return cond, diffusers_world_caption(self.negative_prompt, negative=True, **common)

    def conditioning_clip(self) -> torch.Tensor | None:
        """Pixels of the frames that become clean latents -> float32 [1, 3, n, height, width] in [-1, 1]
        (n = 1 for image -> video, 4 * max(clean) + 1 for video -> video); None when nothing is clean."""
        if self.image is not None:
            return diffusers_cover_crop(self.image, self.height, self.width)[:, :, None]
        if self.video is None:
            return None
        n = VAE_TEMPORAL * max(self.clean_latent_frames) + 1
        kept = self.video[:n] if self.condition_video_keep == "first" else self.video[-n:]
        # A video shorter than n frames is padded by repeating its last kept frame.
        picked = [kept[min(i, len(kept) - 1)] for i in range(n)]
        cache: dict[int, torch.Tensor] = {}
        for frame in picked:
            if id(frame) not in cache:
                cache[id(frame)] = diffusers_resize_frame(frame, self.height, self.width)  # [1, 3, H, W]
        return torch.stack([cache[id(f)] for f in picked], dim=2)  # [1, 3, n, H, W]

    def prepare(
        self,
        cfg: Cosmos3Config,
        encoder: FrameEncoder,
        tokenizer: CaptionTokenizer,
        *,
        sound_decoder: SoundDecoder | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
        control_videos: list | None = None,
    ) -> PreparedWorld:
        """Tokenize both branches, encode the conditioning (and a transfer's controls: `control_videos`, uint8
        [num_frames, height, width, 3] each, made here when not given), draw the noise as the reference does."""
        check_vae(cfg, encoder)
        sound_frames = self._sound_frames(cfg, sound_decoder)
        device = torch.device(device)
        timings: dict[str, float] = {}
        lat = self.latent

        t0 = time.perf_counter()
        cond_ids, uncond_ids = tokenize_branches(tokenizer, cfg, *self.captions(), self.system_prompt)
        timings["tokenize"] = 1e3 * (time.perf_counter() - t0)

        t0 = time.perf_counter()
        clip = self.conditioning_clip()
        timings["preprocess"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        x0 = None if clip is None else encoder.encode(clip).to(device)  # [1, C, max(clean) + 1, h, w]
        timings["vae_encode"] = 1e3 * (time.perf_counter() - t0)
        controls = None
        if self.transfer is not None:
            t0 = time.perf_counter()
            if control_videos is None:
                control_videos = self.transfer.videos(self.height, self.width, self.num_frames)
            timings["controls"] = 1e3 * (time.perf_counter() - t0)
            t0 = time.perf_counter()
            controls = encode_controls(self.transfer, control_videos, encoder, device)
            timings["control_encode"] = 1e3 * (time.perf_counter() - t0)

        # One generator, vision first, then sound, vision drawn whole even where it is overwritten.
        vision = draw_noise((1, cfg.latent_channel, lat.latent_t, lat.latent_h, lat.latent_w), generator, device)
        clean = torch.tensor(self.clean_latent_frames, dtype=torch.long, device=device)
        if x0 is not None:
            vision[:, :, clean] = x0[:, :, clean]
        vision_noisy = ~torch.isin(torch.arange(lat.latent_t, device=device), clean)[None]  # [1, T]
        sound = sound_noisy = None
        if sound_frames:
            assert cfg.sound_dim is not None
            sound = draw_noise((cfg.sound_dim, sound_frames), generator, device)[None]  # [1, S, Ts]
            sound_noisy = torch.ones(1, sound_frames, dtype=torch.bool, device=device)

        n = 0 if controls is None else controls.latents.shape[1]
        nocontrol = None
        if self.transfer is not None and self.transfer.control_guidance != 1.0:
            nocontrol = packed_branch(cfg, cond_ids, lat, self.fps, device)
        inputs = DenoiseInputs(
            cond=packed_branch(cfg, cond_ids, lat, self.fps, device, sound_frames=sound_frames, controls=n),
            uncond=packed_branch(cfg, uncond_ids, lat, self.fps, device, sound_frames=sound_frames, controls=n),
            vision=vision,
            vision_noisy=vision_noisy,
            sound=sound,
            sound_noisy=sound_noisy,
            controls=None if controls is None else controls.latents,
            control_weights=None if controls is None else controls.weights,
            nocontrol=nocontrol,
        )
        return PreparedWorld(self, inputs, lat, tuple(cond_ids), tuple(uncond_ids), sound_frames, timings)

    def _sound_frames(self, cfg: Cosmos3Config, sound_decoder: SoundDecoder | None) -> int:
        if not self.enable_sound:
            return 0
        if not cfg.sound_gen or cfg.sound_dim is None:
            raise RequestError("the transformer has no sound heads (sound_gen=False)", field="enable_sound")
        if sound_decoder is None:
            raise RequestError("sound needs the checkpoint's sound tokenizer", field="sound_decoder")
        if sound_decoder.latent_channels != cfg.sound_dim:
            raise RequestError(
                f"sound tokenizer takes {sound_decoder.latent_channels} latent channels, the transformer "
                f"makes {cfg.sound_dim}",
                field="sound_decoder",
            )
        frames = sound_decoder.latent_frames(self.num_frames, self.fps)
        if frames < 1:
            raise RequestError(
                f"{self.num_frames} frames at {self.fps} fps last less than one sound sample", field="fps"
            )
        return frames


@dataclass(frozen=True, eq=False)
class PreparedWorld:
    """A request turned into the loop's inputs (noise already drawn)."""

    request: WorldRequest
    inputs: DenoiseInputs
    latent: LatentGeometry
    cond_ids: tuple[int, ...]
    uncond_ids: tuple[int, ...]
    sound_frames: int  # 0 without sound
    timings_ms: dict[str, float]


def _multiple_of_spatial(value: Any, name: str) -> int:
    size = positive_int(value, name)
    if size % VAE_SPATIAL:
        raise RequestError(f"must be a multiple of {VAE_SPATIAL} (the VAE's spatial factor), got {size}", field=name)
    return size


def _condition_latent_frames(value: Any, latent_t: int) -> tuple[int, ...]:
    name = "condition_latent_frames"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise RequestError(f"must be a non-empty list of latent frame indexes, got {value!r}", field=name)
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in value):
        raise RequestError(f"must hold integers >= 0, got {list(value)!r}", field=name)
    if max(value) >= latent_t:
        raise RequestError(f"index {max(value)} is outside the {latent_t} latent frames", field=name)
    return tuple(sorted({int(i) for i in value}))


def world_request(
    *,
    prompt: str,
    negative_prompt: str | None = None,
    image: ImageInput | None = None,
    video: VideoInput | None = None,
    condition_latent_frames: Sequence[int] | None = None,
    condition_video_keep: str = "first",
    num_frames: int = 189,
    height: int = 720,
    width: int = 1280,
    fps: float = 24.0,
    enable_sound: bool = False,
    use_system_prompt: bool = True,
    use_resolution_template: bool = True,
    use_duration_template: bool = True,
    controls: Mapping[str, Any] | None = None,
    control_source: VideoInput | None = None,
    control_guidance: float | None = None,
    control_guidance_interval: Sequence[float] | None = None,
    emphasize_control: bool = True,
    num_video_frames_per_chunk: int | None = None,
    num_conditional_frames: int = 1,
) -> WorldRequest:
    """Validate a world request (RequestError naming the field for anything the reference would refuse,
    ignore or mis-handle). Defaults are the reference's; the transfer and chunk options are cosmos-framework's."""
    text_field(prompt, "prompt")
    text_field(negative_prompt, "negative_prompt", optional=True)
    frames = positive_int(num_frames, "num_frames")
    if (frames - 1) % VAE_TEMPORAL:
        # The VAE keeps 1 + 4k frames: the reference would drop the rest yet describe them in the prompt.
        raise RequestError(f"must be 4k + 1 (1, 5, 9, ...), got {frames}", field="num_frames")
    h, w = _multiple_of_spatial(height, "height"), _multiple_of_spatial(width, "width")
    fps_f = finite_number(fps, "fps", positive=True)
    if condition_video_keep not in VIDEO_KEEP:
        raise RequestError(f"must be one of {list(VIDEO_KEEP)}, got {condition_video_keep!r}",
                           field="condition_video_keep")
    if image is not None and video is not None:
        raise RequestError("give either image or video, not both", field="image")
    if image is not None and frames == 1:
        raise RequestError("a single frame is generated from text only (the reference ignores the image)",
                           field="image")
    if video is not None and frames == 1:
        raise RequestError("video -> video needs num_frames > 1", field="video")
    if condition_latent_frames is not None and video is None:
        raise RequestError("condition frames select frames of a video; no video was given",
                           field="condition_latent_frames")

    sound = bool_field(enable_sound, "enable_sound")
    transfer = transfer_spec(controls, control_source, control_guidance, control_guidance_interval,
                             emphasize_control, enable_sound=sound, num_frames=frames)
    chunks = chunk_plan(frames, num_video_frames_per_chunk, num_conditional_frames, enable_sound=sound)
    cond_image = None if image is None else rgb_image(image, "image")
    cond_video = None if video is None else rgb_frames(video, "video")
    if cond_video is not None:
        clean = _condition_latent_frames(  # frames of the first chunk when in chunks
            DEFAULT_CONDITION_LATENT_FRAMES if condition_latent_frames is None else condition_latent_frames,
            latent_geometry(frames if chunks is None else chunks.frames, h, w).latent_t,
        )
    else:
        clean = (0,) if cond_image is not None else ()
    return WorldRequest(
        prompt=prompt,
        negative_prompt="" if negative_prompt is None else negative_prompt,
        num_frames=frames,
        height=h,
        width=w,
        fps=fps_f,
        image=cond_image,
        video=cond_video,
        clean_latent_frames=clean,
        condition_video_keep=condition_video_keep,
        enable_sound=sound,
        use_system_prompt=bool_field(use_system_prompt, "use_system_prompt"),
        use_resolution_template=bool_field(use_resolution_template, "use_resolution_template"),
        use_duration_template=bool_field(use_duration_template, "use_duration_template"),
        transfer=transfer,
        chunks=chunks,
    )


# ------------------------------------------------------------------------------------------------
# Running


@dataclass
class WorldResult:
    video_latents: torch.Tensor  # [1, C, T, height/16, width/16] float32, normalised
    frames: torch.Tensor | None  # uint8 [num_frames, height, width, 3] when decoded
    sound_latents: torch.Tensor | None  # [sound_dim, Ts] float32 with sound
    sound: torch.Tensor | None  # float32 [channels, samples] in [-1, 1] with sound, when decoded
    timings_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the caller should know (e.g. a tiled decode)
    # A clip made in chunks: each chunk's final latents (`video_latents` is the last one's; frames are stitched).
    chunk_latents: list[torch.Tensor] = field(default_factory=list)


def decode_to_frames(decoder: PixelDecoder, encoder: FrameEncoder, latents: torch.Tensor, timings: dict[str, float],
                     notes: list[str]) -> torch.Tensor:
    """Final latents -> uint8 frames [T, H, W, 3] on the host, timed as `vae_decode`; what the decode reports (a
    tiled fallback) goes to `notes`."""
    t0 = time.perf_counter()
    frames = pixels_to_uint8(decoder(encoder, latents, notes=notes)).cpu()  # rounded where the pixels are
    timings["vae_decode"] = 1e3 * (time.perf_counter() - t0)
    return frames


@torch.inference_mode()
def run_world(
    model: Cosmos3Transformer,
    encoder: FrameEncoder,
    tokenizer: CaptionTokenizer | Any,
    *,
    sound_decoder: SoundDecoder | Cosmos3AVAEAudioTokenizer | None = None,
    steps: int = 35,
    guidance: float = 6.0,
    shift: float = 10.0,
    generator: torch.Generator | None = None,
    decode: bool = True,
    on_step: Callable[[int, int], None] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
    denoiser: Denoiser = denoise,
    decoder: PixelDecoder = decode_pixels,
    **request: Any,
) -> WorldResult:
    """One world request end to end (the reference's `pipe(prompt, ...)` without `action`).

    `request`: the fields of `world_request` (prompt, image / video conditioning, size, frames, sound, templates,
    transfer controls, chunking), validated there with its defaults.
    `shift` is the flow shift of the checkpoint's UniPC scheduler (10 in diffusers' Cosmos 3 examples).
    `decode=False` returns latents only (sound latents too, undecoded). `on_step(i, steps)` is called after
    each denoising step (see `denoise`); an exception it raises stops the request there. `on_stage(name)` is
    called between the request's stages ("prepared": tokenized, conditioning encoded, noise drawn; "denoised",
    before the decode), where a server may hand the device to other work.
    `denoiser` and `decoder` are where speed comes in from outside (`wamrt.engine.world.WorldEngine`): the
    eager loop and VAE decode by default.

    Video transfer (`transfer.py`): `controls` maps hints ("edge", "blur", "depth", "seg") to True or options
    (`control_weight`, `preset_edge_threshold` / `preset_blur_strength`, `video`: the control video itself); edge
    and blur without a video are computed from `control_source`. `control_guidance` None: the single hint's recipe
    value. Long videos (`chunks.py`): with `num_video_frames_per_chunk` below `num_frames` the clip is made in
    chunks, `on_chunk(k, chunks)` called before chunk k (its steps then report through `on_step`); chunk k > 0
    draws from a generator seeded `generator.initial_seed() + k`.
    """
    t_start = time.perf_counter()
    opts = diffusers_sampling(steps, guidance, shift)
    req = world_request(**request)
    if req.transfer is not None:
        opts = replace(opts, control_guidance=req.transfer.control_guidance,
                       control_guidance_interval=req.transfer.control_guidance_interval)
    tokenizer = as_caption_tokenizer(tokenizer)
    if isinstance(sound_decoder, Cosmos3AVAEAudioTokenizer):
        sound_decoder = SoundDecoder(sound_decoder)

    def run_one(sub: WorldRequest, gen: torch.Generator | None, control_videos: list | None = None,
                keep_frames: bool = decode) -> WorldResult:
        prepared = sub.prepare(model.config, encoder, tokenizer, sound_decoder=sound_decoder, generator=gen,
                               device=model_device(model), control_videos=control_videos)
        if on_stage is not None:
            on_stage("prepared")
        out = denoiser(model, prepared.inputs, opts, on_step=on_step)
        timings = {**prepared.timings_ms, **out.timings_ms}
        sound_latents = None if out.sound is None else out.sound[0].float()
        frames = sound = None
        notes: list[str] = []
        if keep_frames:
            if on_stage is not None:
                on_stage("denoised")
            frames = decode_to_frames(decoder, encoder, out.vision, timings, notes)
            if sound_latents is not None:
                assert sound_decoder is not None
                t0 = time.perf_counter()
                sound = sound_decoder.decode(sound_latents)
                timings["sound_decode"] = 1e3 * (time.perf_counter() - t0)
        return WorldResult(out.vision.float(), frames, sound_latents, sound, timings, notes)

    if req.chunks is None:
        result = run_one(req, generator)
    else:  # later chunks start from generated frames: every chunk is decoded
        result = run_chunks(partial(run_one, keep_frames=True), req, generator, on_chunk)
        if not decode:
            result.frames = None
    result.timings_ms["total"] = 1e3 * (time.perf_counter() - t_start)
    return result
