"""`wamrt bench world`: world generation end to end (prompt in -> decoded frames on the host), our
`WorldEngine` against diffusers 0.42.1's `Cosmos3OmniPipeline.__call__` on the same random weights, VAE and
tokenizer, in the same process.

Modes: `t2i` (text -> image, 1024x1024) and `i2v` (image -> video, 480x832, 33 frames), at the pipeline's
default 35 steps and guidance 6; `t2v720` (720p x 189 frames with sound) and `transfer` (480p edge transfer), the
peers' own workload, compared per step (`world_large.py`; not in one run with t2i / i2v). The peer runs first, so it
cannot profit from anything our runs leave behind
(compiled code, cuDNN's autotuning cache). Text goes through a word-level stand-in tokenizer (about one token
per word, as a BPE vocabulary gives English): prompt lengths matter for speed, ids do not.
Writes one `kind: latency` JSON per mode (field `mode`, the peer in `peer`) and a PNG of the stage split.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..engine.epilogues import quack_available
from ..ops.attention import fa4_available, measure_backends
from ..provenance import environment
from .catalog import WORLD_MODES
from .flops import request_flops
from .rows import time_requests
from .stats import median_stages, summarize

PROMPT = ("A robot arm in a bright kitchen picks up a red apple from a wooden table and places it gently into a "
          "white ceramic bowl, while the camera slowly pans to the right.")
PEAK_BF16_TFLOPS = 790.0  # performance.md: measured dense bf16 matmul ceiling of the H200


def conditioning_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A smooth scene with texture (resizes and the VAE do real work); its own size, scaled by the pipeline."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([200 * yy / height, 200 * xx / width, 128 + 60 * np.sin((xx + yy) / 17)], axis=-1)
    return Image.fromarray(np.clip(base + rng.integers(-20, 20, (height, width, 3)), 0, 255).astype(np.uint8))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _StageClock:
    """Times calls of an object's methods (synchronised), for the peer's stage split; undone on exit."""

    def __init__(self, dev: torch.device, targets: list[tuple[Any, str, str]]) -> None:
        self.dev, self.targets, self.ms = dev, targets, {}

    def __enter__(self) -> _StageClock:
        for obj, method, stage in self.targets:
            inner = getattr(obj, method)

            def timed(*a, _inner=inner, _stage=stage, **kw):
                _sync(self.dev)
                t0 = time.perf_counter()
                out = _inner(*a, **kw)
                _sync(self.dev)
                self.ms[_stage] = self.ms.get(_stage, 0.0) + 1e3 * (time.perf_counter() - t0)
                return out

            setattr(obj, method, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, method, _ in self.targets:
            delattr(obj, method)  # the instance attribute shadowed the class's method


def run(args: argparse.Namespace) -> int:
    from diffusers import Cosmos3OmniPipeline
    from transformers import AutoTokenizer

    from ..engine import EngineConfig
    from ..engine.world import WORLD_ENGINE_CONFIG, WorldEngine
    from ..pipeline.builtin import write_tokenizer
    from ..pipeline.omni import tokenize_branches
    from ..pipeline.random_weights import random_transformer, random_vae
    from ..pipeline.tokens import CaptionTokenizer
    from ..pipeline.vae import FrameEncoder
    from ..pipeline.world import world_request
    from .peer_diffusers import diffusers_twin, diffusers_unipc
    from .world_large import LARGE_MODES

    unknown = sorted(set(args.modes) - set(WORLD_MODES) - set(LARGE_MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {list(WORLD_MODES) + list(LARGE_MODES)}")
    if set(args.modes) & set(LARGE_MODES):
        if set(args.modes) - set(LARGE_MODES):
            raise SystemExit(f"--modes: {', '.join(LARGE_MODES)} run on their own (a model with sound heads)")
        from .world_large import run as run_large

        return run_large(args)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    if args.epilogues == "quack" and not quack_available(dev):  # before minutes of peer time, not after
        raise SystemExit("--epilogues quack: needs quack-kernels installed and a Hopper or Blackwell GPU")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = "wamrt bench world " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "world"] else sys.argv[1:])

    model = random_transformer(args.model, dev, dtype, layers=args.layers)
    vae = random_vae(dev, dtype, tiny=args.tiny_vae)
    tok_dir = Path(tempfile.mkdtemp(prefix="wamrt-words-"))
    write_tokenizer(tok_dir, level="words")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    tokenizer = CaptionTokenizer(hf_tokenizer)
    cfg = model.config
    sizes = {"t2i": args.t2i_size, "i2v": args.i2v_size}
    frames = {"t2i": 1, "i2v": args.i2v_frames}

    peer = None
    if args.peer == "diffusers":
        pipe = Cosmos3OmniPipeline(transformer=diffusers_twin(model), text_tokenizer=hf_tokenizer, vae=vae,
                                   scheduler=diffusers_unipc(args.shift), sound_tokenizer=None,
                                   enable_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        peer = pipe
    attention_ms = None
    if dev.type == "cuda":
        attention = args.attention
        if attention == "measure":  # the fastest kernel at the largest mode's Generator attention (both branches)
            g_max = max(_generator_tokens(cfg, frames[m], *sizes[m]) for m in args.modes)
            attention_ms = measure_generator_attention(cfg, g_max, g_max + WORLD_ENGINE_CONFIG.prompt_bucket * 2,
                                                       dtype, dev)
            attention = min(attention_ms, key=attention_ms.get)
            print(f"generator attention per call (ms) at {g_max} tokens: {attention_ms} -> {attention}", flush=True)
        config = replace(WORLD_ENGINE_CONFIG, compile_mode=args.compile_mode, attention=attention,
                         epilogues=args.epilogues, last_layer_read_rows=not args.all_rows)
    else:
        config = EngineConfig(attention="auto", compile=False, cuda_graph=False,
                              prompt_bucket=WORLD_ENGINE_CONFIG.prompt_bucket, epilogues=args.epilogues,
                              last_layer_read_rows=not args.all_rows)
    engine: WorldEngine | None = None  # built after the peer has run (fusing swaps the layers' weights)

    results = []
    for mode in args.modes:
        (h, w), n_frames = sizes[mode], frames[mode]
        label = f"text -> image {h}x{w}" if mode == "t2i" else f"image -> video {h}x{w}, {n_frames} frames"
        image = conditioning_image(h, w) if mode == "i2v" else None
        request = dict(prompt=PROMPT, num_frames=n_frames, height=h, width=w, image=image)
        sampling = dict(steps=args.steps, guidance=args.guidance, shift=args.shift)
        wreq = world_request(**request)
        cond_ids, uncond_ids = tokenize_branches(tokenizer, cfg, *wreq.captions(), wreq.system_prompt)
        gen_tokens = _generator_tokens(cfg, n_frames, h, w)
        flops = request_flops(cfg, text=[len(cond_ids), len(uncond_ids)], gen_tokens=gen_tokens,
                              cfg_steps=[args.guidance != 1.0] * args.steps)
        print(f"[{mode}] {label}: {gen_tokens} Generator tokens per branch, text "
              f"{len(cond_ids)}/{len(uncond_ids)}, {flops / 1e12:.0f} TFLOP per request", flush=True)

        peer_result = None
        if peer is not None:
            clock_targets = [(peer.vae, "decode", "vae_decode"), (peer, "_encode_video", "vae_encode")]

            def peer_once(i: int) -> dict[str, float]:
                with _StageClock(dev, clock_targets) as clock:
                    _sync(dev)
                    t0 = time.perf_counter()
                    out = peer(prompt=PROMPT, image=image, num_frames=n_frames, height=h, width=w,
                               num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="np",
                               generator=torch.Generator().manual_seed(1000 + i), enable_safety_check=False)
                    total = 1e3 * (time.perf_counter() - t0)
                assert np.isfinite(out.video).all()
                st = dict(clock.ms)
                st["denoise_and_rest"] = total - sum(st.values())
                return st

            ptimes, pstages = time_requests(peer_once, args.peer_warmup, args.peer_runs)
            peer_result = {"name": "diffusers 0.42.1 Cosmos3OmniPipeline.__call__", **summarize(ptimes),
                           "stages_ms": median_stages(pstages)}
            print(f"[{mode}] peer p50 {peer_result['p50_ms']:.0f} ms {peer_result['stages_ms']}", flush=True)

        if engine is None:
            engine = WorldEngine(model, FrameEncoder(vae), tokenizer, config)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        def ours_once(i: int) -> dict[str, float]:
            res = engine.run(**request, **sampling, generator=torch.Generator().manual_seed(1000 + i))
            assert res.frames is not None and res.frames.shape[0] == n_frames
            return res.timings_ms

        t_row = time.perf_counter()
        times, stages = time_requests(ours_once, args.warmup, args.runs)
        summary = summarize(times)
        decode_ms = compare_decodes(engine, request, sampling)
        floor = 1e3 * flops / (PEAK_BF16_TFLOPS * 1e12)
        stage_ms = median_stages(stages)
        result = {
            "kind": "latency", "command": command, **env, "model": args.model, "mode": mode,
            "mode_label": label, "height": h, "width": w, "num_frames": n_frames, "tier": None,
            "steps": args.steps, "guidance": args.guidance, "shift": args.shift, "guidance_interval": None,
            "recipe": "bf16" if dtype == torch.bfloat16 else "fp32", "parallel": "none", "gpus": 1, "batch": 1,
            "weights": "random", **summary, "warmup": args.warmup,
            "floor_ms": floor, "floor_note": "transformer bf16 compute at 790 TFLOP/s; VAE work not included",
            "stages_ms": stage_ms,
            "stages_note": "tokenize, preprocess, vae_encode (conditioning frames only), reasoner_prefill (both "
                           "branches, once), denoise (all steps), vae_decode (to uint8 frames on the host)",
            "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
            "peer": peer_result, "speedup_vs_peer": peer_result["p50_ms"] / summary["p50_ms"] if peer_result else None,
            "engine": {**{k: getattr(engine.config, k) for k in ("attention", "compile", "compile_mode", "cuda_graph",
                                                                  "prompt_bucket", "batch_cfg", "epilogues",
                                                                  "last_layer_read_rows")},
                       "head_epilogue": engine.head_epilogue, "implicit_pad_decode": engine.implicit_pad_decode,
                       "bucket_attention": engine.bucket_attention, "graph_captures": engine.graphs.captures,
                       "capture_seconds": engine.graphs.capture_seconds},
            "layers": cfg.num_hidden_layers, "generator_tokens": gen_tokens,
            "text_tokens": {"cond": len(cond_ids), "uncond": len(uncond_ids),
                            "note": "word-level stand-in tokenizer (one token per word or punctuation run)"},
            "attention_backend_ms": attention_ms,
            "request_tflop": flops / 1e12, "achieved_tflops": flops / 1e12 / (summary["p50_ms"] / 1e3),
            "denoise_tflops": flops / 1e12 / (stage_ms.get("denoise", float("nan")) / 1e3),
            "decode_ms": decode_ms,
            "row_wall_s": time.perf_counter() - t_row,
        }
        results.append(result)
        (out_dir / f"{args.model}-{mode}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"[{mode}] ours p50 {summary['p50_ms']:.0f} ms CI {summary['ci95_p50_ms']} "
              f"x{result['speedup_vs_peer'] or float('nan'):.2f} vs peer | {stage_ms}", flush=True)
    try:
        plot_stages(results, out_dir / f"world-{args.model}.png", env.get("gpu", ""))
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
    print(json.dumps([{k: r[k] for k in ("mode", "p50_ms", "speedup_vs_peer")} for r in results]))
    return 0


def measure_generator_attention(cfg, queries: int, keys: int, dtype: torch.dtype, device: torch.device
                                ) -> dict[str, float]:
    """Device ms per Generator attention call (both CFG branches) for each backend, timed over the K/V heads the
    engine's step buffers would hold for it: the model's K/V heads for flash-attn-4 (`gqa_buffers`, on by default with
    fa4: the kernel shares each across its query heads), every query head for the others (heads repeated once per
    step). Timing fa4 over repeated heads too undersold it: that is not what the engine runs."""
    q_shape = (2, cfg.num_attention_heads, queries, cfg.head_dim)
    out = measure_backends(q_shape, cfg.num_attention_heads, keys, dtype=dtype, device=device,
                           backends=("cudnn", "flash", "efficient"))
    if fa4_available(device):
        out |= measure_backends(q_shape, cfg.num_key_value_heads, keys, dtype=dtype, device=device, backends=("fa4",))
    return out


def compare_decodes(engine, request: dict, sampling: dict, runs: int = 3) -> dict[str, float]:
    """Median VAE decode (normalised latents -> float pixels on the device) of one request's latents with diffusers'
    causal convolutions and norms (`diffusers_convs`), with implicit-padding convolutions only (`implicit_pad`) and
    with the engine's default, implicit padding plus the fused norm and SiLU and the fused residual and up blocks
    (`implicit_pad_fused_norm`), after one untimed call each (it absorbs compiles)."""
    from ..engine.vae_decode import implicit_pad_decoder

    latents = engine.run(**request, **sampling, generator=torch.Generator().manual_seed(0), decode=False).video_latents
    vae = engine.encoder.vae
    # (engine.implicit_pad_decode, swap around engine.decode_pixels): the engine swaps nothing when its flag is off,
    # so the convolutions-only swap here never nests inside the engine's (the swap's lock is not reentrant).
    variants = {
        "diffusers_convs": (False, nullcontext),
        "implicit_pad": (False, lambda: implicit_pad_decoder(vae, fuse_norms=False)),
        "implicit_pad_fused_norm": (True, nullcontext),
    }
    saved, out = engine.implicit_pad_decode, {}
    try:
        for name, (flag, swap) in variants.items():
            engine.implicit_pad_decode = flag
            times = []
            for i in range(runs + 1):
                _sync(engine.device)
                t0 = time.perf_counter()
                with swap():
                    engine.decode_pixels(engine.encoder, latents)
                _sync(engine.device)
                if i:
                    times.append(1e3 * (time.perf_counter() - t0))
            out[name] = float(np.median(times))
    finally:
        engine.implicit_pad_decode = saved
    return out


def plot_stages(results: list[dict], path: Path, gpu: str) -> None:
    """Per mode, ours and the peer side by side, each bar split into encode / denoise / decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4.2), squeeze=False)
    colors = {"encode + prep": "#8c8c8c", "prefill + denoise": "#4c72b0", "decode": "#dd8452"}
    for ax, r in zip(axes[0], results, strict=True):
        bars = [("wamrt", r["stages_ms"], r["p50_ms"])]
        if r.get("peer"):
            bars.append(("diffusers", r["peer"]["stages_ms"], r["peer"]["p50_ms"]))
        for x, (_, st, total) in enumerate(bars):
            decode = st.get("vae_decode", 0.0) + st.get("sound_decode", 0.0)
            # ours: prefill + denoise; the peer's loop (its Reasoner runs inside): the rest of its time
            denoise = (st.get("denoise", 0.0) + st.get("reasoner_prefill", 0.0)) or st.get("denoise_and_rest", 0.0)
            parts = {"encode + prep": max(total - decode - denoise, 0.0), "prefill + denoise": denoise,
                     "decode": decode}
            bottom = 0.0
            for label, v in parts.items():
                ax.bar(x, v, bottom=bottom, color=colors[label], label=label if x == 0 else None)
                bottom += v
            ax.text(x, total, f"{total / 1e3:.2f} s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars])
        speed = f" (x{r['speedup_vs_peer']:.2f})" if r.get("speedup_vs_peer") else ""
        ax.set_title(f"{r['model']} {r['mode_label']}{speed}", fontsize=9)
        ax.set_ylabel("end-to-end p50 (ms)")
        ax.legend(fontsize=7)
    fig.suptitle(f"World generation, {results[0]['steps']} steps, guidance {results[0]['guidance']}, bf16, random "
                 f"weights, {gpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _generator_tokens(cfg, num_frames: int, height: int, width: int) -> int:
    from ..pipeline.geometry import latent_geometry

    lat, p = latent_geometry(num_frames, height, width), cfg.latent_patch_size
    return lat.latent_t * (-(-lat.latent_h // p)) * (-(-lat.latent_w // p))
