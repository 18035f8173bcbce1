"""`wamrt generate`: one world-generation request from the command line -> an MP4 (H.264, AAC with sound) or a
PNG, with a progress bar over the denoising steps.

The request is what `POST /v1/videos/sync` (or `/v1/images/generations` for a PNG) would receive, built and
validated by the server's own `build_generation`, so the flags mean what the HTTP fields mean and share their
defaults (vLLM-Omni's Cosmos 3 recipe). On a CUDA device it runs on a `WorldEngine` (`--eager`: the reference
pipeline); a distilled checkpoint runs its few-step sampler (`--sampler`). On a CPU the size, frame count and
steps the flags leave out are small ones (`CPU_DEFAULTS`): the GPU defaults would run for half an hour.

Video transfer: `--control edge[:WEIGHT]` (edge, blur, depth, seg; repeatable) with `--control-video PATH`, the
source video edge and blur are computed from; a control given as its own video is `--control-upload KEY=PATH`
(depth and segmentation always are). Long videos: `--chunk-frames 93` (transfer's default) makes the clip in chunks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# What a CPU runs when the flags leave these out: ~15 s for tiny-world on 2 cores (the GPU defaults, 1280x720 x 189
# frames x 35 steps, measured ~26 min). Steps are left to a distilled checkpoint's own schedule.
CPU_DEFAULTS = {"video": {"size": "384x224", "num_frames": "17", "num_inference_steps": "12"},
                "image": {"size": "384x384", "num_inference_steps": "12"}}
LONG_JOB_S = 60.0  # a projected denoising time above this gets a warning with the estimate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-world",
                    help="checkpoint folder, built-in name or random:SIZE (default: tiny-world, sound heads included)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's text_tokenizer/ or tokenizer/)")
    ap.add_argument("--vae", help="VAE folder (default: the checkpoint's vae/)")
    ap.add_argument("--prompt", required=True, help="what the video (or image) shows")
    ap.add_argument("--negative-prompt", help="what to steer away from (default: the pipeline's)")
    ap.add_argument("--image", type=Path, help="image -> video: the first frame (PNG, JPEG, ...)")
    ap.add_argument("--video", type=Path, help="video -> video: an MP4 whose first frames condition")
    ap.add_argument("--size", help="WIDTHxHEIGHT, multiples of 16 (default: 1280x720 video, 1024x1024 image; on a "
                    "CPU 384x224 / 384x384)")
    ap.add_argument("--frames", type=int, help="4k + 1 frames (default 189; on a CPU 17; an .png --out makes one "
                    "image)")
    ap.add_argument("--fps", type=float, help="frame rate of the clip (default 24)")
    ap.add_argument("--steps", type=int, help="denoising steps (default 35 video / 50 image; on a CPU 12; distilled: "
                    "its own)")
    ap.add_argument("--guidance", type=float, help="CFG scale (default 6 video / 7 image; distilled: 1)")
    ap.add_argument("--shift", type=float, help="flow shift of the UniPC schedule (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="noise seed")
    ap.add_argument("--sound", action="store_true", help="generate a sound track too (checkpoints with sound heads)")
    ap.add_argument("--upsample-prompt", action="store_true",
                    help="the Reasoner first rewrites the prompt as a structured JSON scene caption (docs/reasoner.md)")
    ap.add_argument("--upsample-max-tokens", type=int, default=1024, help="tokens the Reasoner may write for it")
    ap.add_argument("--templates", action="store_true",
                    help="add the resolution and duration sentences to the prompts (diffusers' default)")
    ap.add_argument("--control", action="append", default=[], metavar="KEY[:WEIGHT]",
                    help="video transfer: a control hint (edge, blur, depth, seg), its weight (default 1)")
    ap.add_argument("--control-video", type=Path, help="video transfer: the source video edge / blur are computed from")
    ap.add_argument("--control-upload", action="append", default=[], metavar="KEY=PATH",
                    help="video transfer: a control's own video (depth and seg need one)")
    ap.add_argument("--control-guidance", type=float, help="control guidance (default: the hint's recipe value)")
    ap.add_argument("--edge-preset", help="Canny thresholds: very_low, low, medium (default), high, very_high")
    ap.add_argument("--blur-preset", help="blur strength: none, very_low, low, medium (default), high, very_high")
    ap.add_argument("--chunk-frames", type=int,
                    help="long videos: frames per chunk, 4k + 1 (transfer's default 93; off otherwise)")
    ap.add_argument("--conditional-frames", type=int, help="long videos: frames each chunk continues from (1)")
    ap.add_argument("--sampler", default="auto", choices=["auto", "unipc", "distilled"],
                    help="auto: the distilled sampler when the checkpoint declares a distilled schedule")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--eager", action="store_true", help="the reference pipeline, not the WorldEngine (CUDA)")
    ap.add_argument("--out", type=Path, required=True, help="output file: .mp4 (video) or .png (one image)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def _fields(args: argparse.Namespace) -> dict:
    """The HTTP form fields these flags stand for (`serving.generation_request.build_generation` validates them)."""
    if args.image is not None and args.video is not None:
        raise ValueError("give --image or --video, not both")
    fields: dict = {"prompt": args.prompt, "seed": str(args.seed)}
    for flag, name in (("negative_prompt", "negative_prompt"), ("size", "size"), ("frames", "num_frames"),
                       ("fps", "fps"), ("steps", "num_inference_steps"), ("guidance", "guidance_scale"),
                       ("shift", "flow_shift")):
        value = getattr(args, flag)
        if value is not None:
            fields[name] = str(value)
    if args.sound:
        fields["generate_sound"] = "true"
    reference = args.image or args.video
    if reference is not None:
        if not reference.is_file():
            raise FileNotFoundError(f"no such file: {reference}")
        fields["input_reference"] = reference.read_bytes()
    if args.upsample_prompt:
        fields["upsample_prompt"] = "true"
    extra: dict = {}
    if args.templates:
        extra.update(use_resolution_template=True, use_duration_template=True)
    extra.update(_transfer_extra(args, fields))
    if extra:
        fields["extra_params"] = json.dumps(extra)
    return fields


def _small_defaults(fields: dict[str, Any], kind: str, *, distilled: bool) -> None:
    """CPU_DEFAULTS for the fields the flags left out (said on stderr, so a user knows what ran and why)."""
    chosen = {k: v for k, v in CPU_DEFAULTS[kind].items()
              if k not in fields and not (distilled and k == "num_inference_steps")}
    if chosen:
        fields.update(chosen)
        print("note: on a CPU, small defaults: " + ", ".join(f"{k} {v}" for k, v in chosen.items())
              + " (give --size / --frames / --steps for more)", file=sys.stderr)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _transfer_extra(args: argparse.Namespace, fields: dict) -> dict:
    """The transfer and chunk flags -> extra_params (and the uploads into `fields`), as an HTTP client sends them."""
    extra: dict = {}
    for spec in args.control:
        key, _, weight = spec.partition(":")
        extra[key] = {"control_weight": float(weight)} if weight else {}
    for spec in args.control_upload:
        key, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise FileNotFoundError(f"--control-upload wants KEY=PATH to a video file, got {spec!r}")
        fields.setdefault("control_reference", []).append(Path(path).read_bytes())
        fields.setdefault("control_type", []).append(key)
        extra.setdefault(key, {})
    if (extra or args.control_video) and (args.image or args.video):
        raise ValueError("video transfer takes its source as --control-video, not --image / --video")
    if args.control_video is not None:
        if not args.control_video.is_file():
            raise FileNotFoundError(f"no such file: {args.control_video}")
        fields["input_reference"] = args.control_video.read_bytes()
    for key, preset in (("edge", args.edge_preset), ("blur", args.blur_preset)):
        if preset is not None:
            extra.setdefault(key, {})[f"preset_{key}_{'threshold' if key == 'edge' else 'strength'}"] = preset
    for flag, name in (("control_guidance", "control_guidance"), ("chunk_frames", "num_video_frames_per_chunk"),
                       ("conditional_frames", "num_conditional_frames")):
        if getattr(args, flag) is not None:
            extra[name] = getattr(args, flag)
    return {k: (v if v != {} else True) for k, v in extra.items()}


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from ..pipeline import RequestError, load_policy
    from ..serving.errors import ServingError
    from ..serving.generation_request import build_generation
    from ..serving.media import audio_rate, encode_mp4, encode_png
    from ..serving.world_model import world_model_of

    suffix = args.out.suffix.lower()
    if suffix not in (".mp4", ".png"):
        print(f"error: --out must end in .mp4 or .png, got {args.out}", file=sys.stderr)
        return 2
    kind = "image" if suffix == ".png" else "video"
    try:
        fields = _fields(args)
        if kind == "image" and fields.pop("num_frames", "1") != "1":
            raise ValueError("a .png holds one image: leave --frames out")
        policy = load_policy(args.model, device=args.device, tokenizer=args.tokenizer, vae=args.vae)
        world = world_model_of(policy, args.model, args.sampler)
        if world is None:
            raise ValueError(f"{args.model} has no world-generation path")
        device = next(policy.model.parameters()).device
        if device.type == "cpu":
            _small_defaults(fields, kind, distilled=world.schedule is not None)
        if device.type == "cuda" and not args.eager:
            from dataclasses import replace

            from ..engine.world import WorldEngine

            world = replace(world, engine=WorldEngine(policy.model, policy.encoder, policy.tokenizer,
                                                      name=str(policy.name)))
        req = build_generation(fields, world, kind=kind, max_pixels=2**62, model_name=args.model)
        upsampled = _upsample(req, policy, args) if req.upsample else None
    except (RequestError, ServingError, ValueError, FileNotFoundError) as e:
        where = getattr(e, "field", None) if isinstance(e, ServingError) else None  # the others' text names it
        print(f"error: {f'{where}: ' if where else ''}{e}", file=sys.stderr)
        return 2

    desc = f"{kind} {req.record.get('size', '')}".strip()
    bar = tqdm(total=req.steps * req.chunks, desc=desc, unit="step", disable=args.quiet, file=sys.stderr)
    t0 = time.perf_counter()

    done = [0]  # steps of every chunk so far (a disabled bar counts nothing)

    def on_step(i: int, steps: int) -> None:
        bar.update(1)
        done[0] += 1
        first = time.perf_counter() - t0
        if done[0] == 1 and (projected := first * steps * req.chunks) > LONG_JOB_S:
            bar.write(f"warning: this job will take about {_duration(projected)} on {device.type} "
                      f"({steps * req.chunks} steps, the first took {first:.1f} s; the VAE decode comes after); "
                      "smaller: --size, --frames, --steps", file=sys.stderr)

    try:
        extra: dict = {"sound_decoder": world.sound} if req.sound else {}
        if req.chunks > 1:
            extra["on_chunk"] = lambda k, n: bar.set_description(f"{desc} chunk {k + 1}/{n}")
        result = world.run(**req.kwargs, **extra, generator=torch.Generator().manual_seed(args.seed), on_step=on_step)
    finally:
        bar.close()
    assert result.frames is not None
    frames = result.frames.numpy()
    wave = None if result.sound is None else result.sound.numpy()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "image":
        args.out.write_bytes(encode_png(frames[0]))
    else:
        rate = world.sound.sampling_rate if wave is not None else None
        args.out.write_bytes(encode_mp4(frames, req.fps, wave, rate, threads=0))
    summary = {
        "out": str(args.out), "kind": kind, "frames": list(frames.shape), "fps": req.fps, "seed": args.seed,
        "sampler": req.sampling, "sound": None if wave is None else {
            "sample_rate": audio_rate(world.sound.sampling_rate), "seconds": wave.shape[1] / world.sound.sampling_rate},
        "engine": "WorldEngine" if world.engine is not None else "eager", "seconds": time.perf_counter() - t0,
        "timings_ms": {k: round(v, 1) for k, v in result.timings_ms.items() if not k.startswith("denoise_step")},
        "notes": list(req.notes) + list(result.notes) + ([upsampled.note] if upsampled and upsampled.note else []),
        "upsampled_prompt": upsampled.as_dict() if upsampled else None,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {kind} {frames.shape[2]}x{frames.shape[1]}"
              + (f", {frames.shape[0]} frames at {req.fps:g} fps" if kind == "video" else "")
              + (f", sound {summary['sound']['seconds']:.2f} s" if wave is not None else "")
              + f" in {summary['seconds']:.1f} s ({summary['engine']}, {req.sampling.get('sampler')} sampler, "
              f"{req.steps} steps)")
        if upsampled is not None:
            print(f"caption ({upsampled.source}): {upsampled.caption}")
        for note in summary["notes"]:
            print(f"note: {note}")
    return 0


def _upsample(req, policy, args: argparse.Namespace):  # noqa: ANN001, ANN202 - GenerationRequest, Policy -> Upsampled
    """Run the Reasoner on the prompt first (in this process, on the loaded weights); the caption replaces it."""
    from ..reasoner import SamplingParams, reasoner_of
    from ..reasoner.upsample import upsample
    from ..serving.upsampling import first_frame, task_of

    reasoner, why = reasoner_of(policy, args.model)
    if reasoner is None:
        raise ValueError(f"--upsample-prompt: {args.model} has no Reasoner text ({why})")
    params = SamplingParams(max_tokens=args.upsample_max_tokens, temperature=0, repetition_penalty=1.05)
    image = first_frame(req.kwargs) if reasoner.vision is not None else None
    out = upsample(task_of(req.kind, req.kwargs), lambda msgs: reasoner.complete(msgs, params).text, image)
    req.kwargs["prompt"] = out.caption
    return out
