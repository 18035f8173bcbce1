"""`wamrt bench world --modes t2v720,transfer`: world generation at the peers' own workload, random weights, one
process, our `WorldEngine` against diffusers 0.42.1's `Cosmos3OmniPipeline.__call__` on the same weights.

* `t2v720`: text -> video 1280x720 (rows x columns 720x1280), 189 frames, with sound (a transformer with sound heads
  and a random sound tokenizer of the released size: 48 kHz, 25 latent frames per second), guidance 6, flow shift
  10 (vLLM-Omni's recipe; its 35 steps are the request's, the step counts run here are below).
* `transfer`: an edge-transfer clip, 480x832, 93 frames (one chunk), guidance 3, control guidance 1.5, shift 10,
  the edge control computed from a synthetic source video. diffusers has no transfer mode: its row is diffusers'
  text -> video at the same size and frames, compared per step (a transfer step runs about 2.6x a text -> video
  step's FLOPs: two branches over twice the tokens and a third over the target alone; `flops_ratio_vs_peer`).

A 720p x 189-frame Nano step is ~44,000 Generator tokens per branch, ~3.6 PFLOP with CFG: ~5.7 s at the i2v rows'
627 TFLOP/s (bench/results/latency/2026-12-04-d668f22-world-fa4-quack). A 35-step request is ~200 s on its own, so
to fit one lease call of a few minutes both sides run fewer steps (`--large-steps`, `--peer-steps`) and are compared
per denoising step (`speedup_per_step`: the peer's median step over ours, from the step boundaries each reports);
`projected_35_step_ms` adds the 35-step request's missing steps at our median step to the measured request. Also
measured: the VAE decode of the clip alone (time, peak memory, tiled or not), and the share of attention in our
step's kernels (torch.profiler over one request's denoising loop, `kernel_split`).

Writes `<model>-<mode>.json` (`kind: latency`, `mode`, `p50_ms`, `peak_mem_gib`, `speedup_per_step`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..provenance import environment
from .catalog import LARGE_WORLD_MODES
from .flops import request_flops
from .rows import kernel_split, top_kernels
from .stats import summarize

LARGE_MODES = tuple(LARGE_WORLD_MODES)
MEASURE_TOKENS = 12_000  # the attention kernels are timed at most this long (`--attention measure`)
PROMPT = ("A robot arm in a bright kitchen picks up a red apple from a wooden table and places it gently into a "
          "white ceramic bowl, while the camera slowly pans to the right.")
RELEASE_SOUND = dict(sampling_rate=48000, vocoder_input_dim=64, encoder_enabled=False)  # diffusers' defaults
TINY_SOUND = dict(sampling_rate=16000, vocoder_input_dim=8, dec_dim=8, dec_c_mults=[1, 2, 4], dec_strides=[4, 8, 20],
                  dec_out_channels=2, encoder_enabled=False)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def source_video(frames: int, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, 3]: shapes moving over a gradient (edges for Canny to find in every frame)."""
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), np.uint8)
    for k in range(frames):
        img = np.stack([200 * yy / height, 200 * xx / width, 100 + 50 * np.sin((xx + yy + 3 * k) / 17)], -1)
        cy, cx, r = height // 2, (width // 4 + 4 * k) % width, max(4, height // 6)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = (230, 40, 40)
        out[k] = img.astype(np.uint8)
    return out


def _build(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype):
    from diffusers import Cosmos3OmniPipeline
    from transformers import AutoTokenizer

    from ..model import Cosmos3Transformer, get_config, init_random_
    from ..pipeline.builtin import random_sound_tokenizer, write_tokenizer
    from ..pipeline.random_weights import random_vae
    from ..pipeline.sound import SoundDecoder
    from ..pipeline.tokens import CaptionTokenizer
    from .peer_diffusers import diffusers_twin, diffusers_unipc

    sound_cfg = TINY_SOUND if args.model.startswith("tiny") else RELEASE_SOUND
    cfg = get_config(args.model).replace(sound_gen=True, sound_dim=sound_cfg["vocoder_input_dim"])
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
    model = init_random_(model.to_empty(device=dev), 0).to(dtype)
    model.time_embedder.to(torch.float32)
    model = model.eval().requires_grad_(False)
    vae = random_vae(dev, dtype, tiny=args.tiny_vae)
    sound = random_sound_tokenizer(sound_cfg, seed=3).to(dev)
    tok_dir = Path(tempfile.mkdtemp(prefix="wamrt-words-"))
    write_tokenizer(tok_dir, level="words")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    pipe = Cosmos3OmniPipeline(transformer=diffusers_twin(model), text_tokenizer=hf_tokenizer, vae=vae,
                               scheduler=diffusers_unipc(10.0), sound_tokenizer=sound, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return model, vae, CaptionTokenizer(hf_tokenizer), SoundDecoder(sound), pipe


def _step_ms(marks: list[float]) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(marks, marks[1:], strict=False)]


def peer_row(pipe, dev: torch.device, steps: int, **call: Any) -> dict[str, Any]:
    """diffusers' pipeline at `steps` steps, latents out (its decode is not timed here: ours is, on its own): the
    request's wall time and its step times from the step-end callback. diffusers' attention call (SDPA with
    enable_gqa) may run PyTorch's math kernel, which holds every score: at 720p x 189 frames that is ~125 GB per
    layer, so on an out-of-memory error the peer runs again with diffusers' own `_native_flash` backend (PyTorch's
    flash kernel, which takes GQA) and the row says so."""
    marks: list[float] = []

    def on_step_end(_pipe, _i, _t, _kw):
        _sync(dev)
        marks.append(time.perf_counter())
        return {}

    backend = "native (diffusers' default)"
    for attempt in range(2):
        marks.clear()
        try:
            _sync(dev)
            t0 = time.perf_counter()
            pipe(prompt=PROMPT, num_inference_steps=steps, output_type="latent", callback_on_step_end=on_step_end,
                 generator=torch.Generator().manual_seed(1000), enable_safety_check=False, **call)
            _sync(dev)
            total = 1e3 * (time.perf_counter() - t0)
            break
        except torch.OutOfMemoryError:
            if attempt:
                raise
            gc.collect()
            torch.cuda.empty_cache()
            pipe.transformer.set_attention_backend("_native_flash")
            backend = "_native_flash (the default ran out of memory)"
    steps_ms = _step_ms([t0, *marks])
    return {"name": "diffusers 0.42.1 Cosmos3OmniPipeline.__call__ (output_type='latent')", "steps": steps,
            "request_ms": total, "step_ms": steps_ms, "step_p50_ms": float(np.median(steps_ms[1:] or steps_ms)),
            "attention_backend": backend,
            "step_note": "step 0 includes tokenizing and packing; the median is over the later steps"}


def ours_row(engine, dev: torch.device, request: dict[str, Any], steps: int, runs: int) -> dict[str, Any]:
    """One warm-up request (compiles, captures) and `runs` timed ones at `steps` steps: wall times, stages and each
    step's time from the engine's step boundaries (it synchronizes before `on_step`)."""
    totals, stages, step_ms = [], [], []
    for i in range(runs + 1):
        marks: list[float] = []
        _sync(dev)
        t0 = time.perf_counter()
        res = engine.run(**request, steps=steps, generator=torch.Generator().manual_seed(1000 + i),
                         on_step=lambda _i, _n, marks=marks: marks.append(time.perf_counter()))
        wall = 1e3 * (time.perf_counter() - t0)
        assert res.frames is not None and res.frames.shape[0] == request["num_frames"]
        if i:  # the first request compiled and captured
            totals.append(wall)
            stages.append(res.timings_ms)
            step_ms += _step_ms(marks)
        notes = res.notes
        del res
    return {"totals": totals, "stages": stages, "step_ms": step_ms, "notes": notes}


def decode_row(engine, latents: torch.Tensor, dev: torch.device, runs: int = 2) -> dict[str, Any]:
    """The VAE decode of one request's latents on its own: median time, the peak memory it adds, tiled or not."""
    times, notes = [], []
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(runs):
        _sync(dev)
        t0 = time.perf_counter()
        engine.decode_pixels(engine.encoder, latents, notes=notes)
        _sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if dev.type == "cuda" else None
    return {"ms": times, "p50_ms": float(np.median(times)), "added_peak_gib": peak, "tiled": bool(notes),
            "latents": list(latents.shape), "note": "the implicit-padding fused decode (the engine's), float pixels "
                                                     "on the device; tiled only if the whole clip did not fit"}


def profiled_request(engine, request: dict[str, Any], steps: int, profile: bool
                     ) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """One more request at the timed shape (its graphs replay), decode off: its latents, and with `profile` the
    kernel time by class over its denoising loop from torch.profiler (the share of attention in a step)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    def once() -> torch.Tensor:
        gen = torch.Generator().manual_seed(7)
        return engine.run(**request, steps=steps, generator=gen, decode=False).video_latents

    if not profile:
        return once(), None
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        latents = once()
    split = kernel_split(prof)
    total = sum(split.values())
    return latents, {"kernel_split_ms": split, "attention_share": split["attention"] / total if total else None,
                     "kernel_top_ms": top_kernels(prof, 12), "steps": steps}


def run(args: argparse.Namespace) -> int:
    from ..engine import EngineConfig
    from ..engine.world import WORLD_ENGINE_CONFIG, WorldEngine
    from ..pipeline.omni import tokenize_branches
    from ..pipeline.vae import FrameEncoder
    from ..pipeline.world import world_request
    from .world import PEAK_BF16_TFLOPS, _generator_tokens, measure_generator_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = "wamrt bench world " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "world"] else sys.argv[1:])
    t_start = time.perf_counter()
    model, vae, tokenizer, sound, pipe = _build(args, dev, dtype)
    cfg = model.config
    print(f"built {args.model} (sound heads) in {time.perf_counter() - t_start:.0f} s", flush=True)
    (h7, w7), (ht, wt) = args.t2v720_size, args.transfer_size
    requests = {
        "t2v720": dict(prompt=PROMPT, num_frames=args.t2v720_frames, height=h7, width=w7, fps=24.0, guidance=6.0,
                       shift=10.0, enable_sound=True, sound_decoder=sound),
        "transfer": dict(prompt=PROMPT, num_frames=args.transfer_frames, height=ht, width=wt, fps=24.0, guidance=3.0,
                         shift=10.0, controls={"edge": True}, control_guidance=1.5,
                         control_source=source_video(args.transfer_frames, ht, wt)),
    }
    peer_calls = {"t2v720": dict(num_frames=args.t2v720_frames, height=h7, width=w7, guidance_scale=6.0,
                                 enable_sound=True),
                  "transfer": dict(num_frames=args.transfer_frames, height=ht, width=wt, guidance_scale=3.0)}
    engine, attention_ms = None, None  # built after the first peer row (fusing swaps the layers' weights)
    results = []
    for mode in args.modes:
        request = requests[mode]
        wreq = world_request(**{k: v for k, v in request.items() if k not in ("guidance", "shift", "sound_decoder")})
        cond_ids, uncond_ids = tokenize_branches(tokenizer, cfg, *wreq.captions(), wreq.system_prompt)
        target = _generator_tokens(cfg, request["num_frames"], request["height"], request["width"])
        sound_rows = sound.latent_frames(request["num_frames"], 24.0) if request.get("enable_sound") else 0
        text = [len(cond_ids), len(uncond_ids)]
        if mode == "transfer":  # [cond; uncond] over control + target, the no-control branch over the target
            step_flops = (request_flops(cfg, text=text, gen_tokens=2 * target, cfg_steps=[True])
                          + request_flops(cfg, text=text[:1], gen_tokens=target, cfg_steps=[False]))
        else:
            step_flops = request_flops(cfg, text=text, gen_tokens=target + sound_rows, cfg_steps=[True])
        peer_flops = request_flops(cfg, text=text, gen_tokens=target + sound_rows, cfg_steps=[True])
        print(f"[{mode}] {target} target tokens (+{sound_rows} sound), {step_flops / 1e12:.0f} TFLOP per step",
              flush=True)

        peer = None
        if args.peer == "diffusers":
            peer = peer_row(pipe, dev, args.peer_steps, **peer_calls[mode])
            print(f"[{mode}] peer step p50 {peer['step_p50_ms']:.0f} ms ({peer['attention_backend']})", flush=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if engine is None:
            config = EngineConfig(attention="auto", compile=False, cuda_graph=False, prompt_bucket=64)
            if dev.type == "cuda":
                attention = args.attention
                if attention == "measure":  # the first mode's Generator attention, at most MEASURE_TOKENS long: at
                    # 44,000 tokens the probe's ~80 calls per kernel would take a minute; all are compute-bound there
                    g = min((2 if mode == "transfer" else 1) * target + sound_rows, MEASURE_TOKENS)
                    attention_ms = measure_generator_attention(cfg, g, g + 128, dtype, dev)
                    attention = min(attention_ms, key=attention_ms.get)
                config = replace(WORLD_ENGINE_CONFIG, attention=attention, epilogues=args.epilogues)
            engine = WorldEngine(model, FrameEncoder(vae), tokenizer, config)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t_row = time.perf_counter()
        ours = ours_row(engine, dev, request, args.large_steps, args.large_runs)
        peak = _peak_gib(dev)
        summary = summarize(ours["totals"])
        step = summarize(ours["step_ms"])
        stage_ms = {k: float(np.median([s[k] for s in ours["stages"] if k in s]))
                    for k in sorted({k for s in ours["stages"] for k in s}) if not k.startswith("denoise_step")}
        latents, profile = profiled_request(engine, request, args.large_steps, args.profile)
        decode = decode_row(engine, latents, dev)
        del latents
        result = {
            "kind": "latency", "command": command, **env, "model": args.model, "mode": mode,
            "height": request["height"], "width": request["width"], "num_frames": request["num_frames"],
            "sound": bool(request.get("enable_sound")), "controls": list(request.get("controls", {})),
            "guidance": request["guidance"], "shift": request["shift"],
            "control_guidance": request.get("control_guidance"), "recipe": "bf16" if dtype == torch.bfloat16
            else "fp32", "weights": "random", "gpus": 1,
            "steps": args.large_steps, "recipe_steps": 35,
            "steps_note": f"{args.large_steps} steps per request here (1 warm-up + {args.large_runs} timed), the peer "
                          f"{args.peer_steps}: a 35-step 720p request takes minutes; compared per step",
            **summary, "step_ms": step, "stages_ms": stage_ms,
            "projected_35_step_ms": summary["p50_ms"] + (35 - args.large_steps) * step["p50_ms"],
            "floor_ms": 1e3 * step_flops * args.large_steps / (PEAK_BF16_TFLOPS * 1e12),
            "floor_note": "transformer bf16 compute of the request's steps at 790 TFLOP/s; VAE work not included",
            "tier": None, "guidance_interval": None, "parallel": "none", "batch": 1, "warmup": 1,
            "peak_mem_gib": peak, "decode": decode, "profile": profile,
            "peer": peer, "peer_mode": "text2video" if mode == "transfer" else mode,
            "speedup_per_step": peer["step_p50_ms"] / step["p50_ms"] if peer else None,
            "flops_ratio_vs_peer": step_flops / peer_flops,
            "step_tflop": step_flops / 1e12, "step_tflops_achieved": step_flops / 1e9 / step["p50_ms"],
            "generator_tokens": {"target": target, "sound": sound_rows,
                                 "controls": target * len(request.get("controls", {}))},
            "text_tokens": {"cond": len(cond_ids), "uncond": len(uncond_ids)},
            "engine": {k: getattr(engine.config, k) for k in ("attention", "compile", "cuda_graph", "prompt_bucket",
                                                             "epilogues", "last_layer_read_rows")},
            "attention_backend_ms": attention_ms, "graph_captures": engine.graphs.captures,
            "capture_seconds": engine.graphs.capture_seconds, "notes": ours["notes"],
            "row_wall_s": time.perf_counter() - t_row,
        }
        results.append(result)
        (out_dir / f"{args.model}-{mode}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"[{mode}] ours p50 {summary['p50_ms']:.0f} ms at {args.large_steps} steps, step p50 "
              f"{step['p50_ms']:.0f} ms (x{result['speedup_per_step'] or float('nan'):.2f} per step vs the peer), "
              f"projected 35 steps {result['projected_35_step_ms'] / 1e3:.1f} s, decode {decode['p50_ms']:.0f} ms, "
              f"peak {peak or 0:.1f} GiB, attention share "
              f"{(profile or {}).get('attention_share')}", flush=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps([{k: r[k] for k in ("mode", "p50_ms", "speedup_per_step", "peak_mem_gib")} for r in results]))
    return 0
