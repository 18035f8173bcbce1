"""`wamrt bench ...` flags. Standard library only (see `wamrt.cli`): each benchmark module is imported when its
command runs; the tables the flags list (latency rows, world modes, load limits) come from `bench.catalog`."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from ..bench.catalog import (
    DEFAULT_ROWS,
    GENERATOR_TOKENS,
    LARGE_WORLD_MODES,
    MAX_LANES,
    MAX_SECONDS,
    ROWS,
    WORLD_MODES,
)
from ..bench.prompts import PROMPT_SETS
from .dispatch import lazy

MODELS = ["edge", "nano", "super", "tiny-qwen", "tiny-edge"]
EPILOGUES = ("inductor", "quack")  # engine.epilogues.EPILOGUES


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (latency waterfall, world generation, load, kernels)")
    commands = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, add, help_text in (
        ("latency", _latency, "latency waterfall E0..E5 on random full-size weights (GPU)"),
        ("world", _world, "world generation (t2i, i2v) end to end vs diffusers on random weights"),
        ("kernels", _kernels, "the Generator's GEMM call sites: cuBLAS + Inductor vs quack's fused epilogues, at "
                              "real shapes (GPU)"),
        ("parallel", _parallel, "latency on 2 GPUs: --parallel cfg (vs one GPU) or tp (Super); --world: t2v steps/s "
                                "over 1-8 GPUs (cfg, ulysses, cfg+ulysses)"),
        ("load", _load, "closed-loop websocket lanes against a loopback server"),
        ("soak", _soak, "a tiny server in its own process under mixed good, bad and abandoned traffic: 5xx, RSS "
                        "growth, policy p99 with vs without the bad traffic (CPU)"),
        ("waterfall", _waterfall, "one chart from committed latency result files (rows of several runs, each "
                                  "labelled with its commit)"),
        ("timeline", _timeline, "a saved --trace request's GPU timeline: busy, idle, segments, gaps"),
        ("decode", _decode, "the Reasoner's decode: prefill and decode tokens/s at batch 1 / 8 / 32 against "
                            "transformers' generate and the HBM floor, random weights (GPU; --tiny: CPU dry run)"),
        ("vae", _vae, "the VAE's frame-0 encode and world decode, kernel option by kernel option, full size on random "
                      "weights (GPU; --tiny-vae: CPU dry run)"),
        ("prefix-cost", _prefix_cost, "what a prefix request costs on the eager reference: none / inpaint / guided "
                                      "(RTC) at each delay, random weights at a real size (GPU; tiny-*: CPU)"),
        ("host-timeline", _host_timeline, "a warm request's host marks against its CUDA graphs on one axis, and a "
                                          "cProfile of the same requests (GPU; tiny-*: CPU dry run, host marks only)"),
    ):
        ap = commands.add_parser(name, help=help_text, description=help_text)
        add(ap)
        ap.set_defaults(func=lazy(f"wamrt.bench.{name.replace('-', '_')}:run"))


def _rows(text: str) -> list[str]:
    return [r for r in text.split(",") if r]


def _height_width(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH, got {text!r}") from e
    return h, w


def _background_fields(text: str) -> dict[str, Any]:
    # Imported on use: it reads the serving package's upload rules (numpy, msgpack), which --help does not need.
    return importlib.import_module("wamrt.bench.background_generation").parse_fields(text)


def _smoke_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", type=int, help="override the layer count (smoke tests; default: the model's)")
    ap.add_argument("--tiny-vae", action="store_true", help="tiny VAE instead of the Wan2.2 size (smoke tests)")


def _latency(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="nano", choices=MODELS,
                    help="tiny-* run the whole bench on CPU in seconds (smoke tests)")
    _smoke_arguments(ap)
    ap.add_argument("--steps", type=int, nargs="+", default=[4], help="denoising steps; several values: one "
                    "waterfall each (later ones run --other-steps-rows only)")
    ap.add_argument("--rows", type=_rows, default=DEFAULT_ROWS,
                    help=f"comma-separated, default {','.join(DEFAULT_ROWS)}; opt-in: "
                         f"{','.join(r for r in ROWS if r not in DEFAULT_ROWS)}")
    ap.add_argument("--other-steps-rows", type=_rows, default=["E5"],
                    help="rows run for the second and later --steps values")
    ap.add_argument("--full-rows", type=_rows, default=["E5"],
                    help="rows timed with --warmup/--runs; the others use --quick-warmup/--quick-runs")
    ap.add_argument("--warmup", type=int, default=10, help="untimed requests before a --full-rows row")
    ap.add_argument("--runs", type=int, default=30, help="timed requests of a --full-rows row")
    ap.add_argument("--pace-hz", type=float, default=0.0,
                    help="start our requests on a clock of this rate (a robot's control loop, e.g. 15) instead of back "
                         "to back; recorded as pace_hz (the peer stays back to back); 0 = back to back")
    ap.add_argument("--quick-warmup", type=int, default=3, help="untimed requests before any other row")
    ap.add_argument("--quick-runs", type=int, default=10, help="timed requests of any other row")
    ap.add_argument("--peer", choices=["none", "diffusers"], default="none",
                    help="also time diffusers' Cosmos3OmniPipeline on the same weights, in the same process")
    ap.add_argument("--peer-all-steps", action="store_true", help="also run the peer for later --steps values")
    ap.add_argument("--peer-warmup", type=int, default=3, help="untimed peer requests")
    ap.add_argument("--peer-runs", type=int, default=10, help="timed peer requests")
    ap.add_argument("--trace", action="store_true", help="profile one extra request of the last row (or --trace-rows)")
    ap.add_argument("--trace-rows", type=_rows, default=[],
                    help="with --trace: the rows to profile (comma-separated), each in its own trace file")
    ap.add_argument("--lossy-rows", type=_rows, default=[],
                    help="lossy rows after the exact ones (E6 gen-fp8, E7 +2 steps, E8 +CFG on the first step only; "
                         "E5-interval / E5-quack-interval: bf16, 4 steps, CFG on the first step only; the variants "
                         "in wamrt.bench.lossy.LOSSY_ROWS)")
    ap.add_argument("--quality", action="store_true",
                    help="with --lossy-rows: per-layer SQNR at full shape, chunk rel-L2 vs bf16, memory per recipe")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--out", default="bench/results/latency", help="folder of the result JSON files and the chart")


def _world(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="nano", choices=MODELS, help="tiny-* run on the CPU in seconds (smoke tests)")
    _smoke_arguments(ap)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(WORLD_MODES),
                    help=f"comma-separated, of {','.join(WORLD_MODES)}; or of {','.join(LARGE_WORLD_MODES)}, the "
                         "peers' workload compared per step (bench/world_large.py)")
    ap.add_argument("--t2i-size", type=_height_width, default=WORLD_MODES["t2i"]["size"], help="HEIGHTxWIDTH")
    ap.add_argument("--i2v-size", type=_height_width, default=WORLD_MODES["i2v"]["size"], help="HEIGHTxWIDTH")
    ap.add_argument("--i2v-frames", type=int, default=WORLD_MODES["i2v"]["num_frames"], help="frames of an i2v clip")
    ap.add_argument("--steps", type=int, default=35, help="denoising steps (Cosmos3OmniPipeline's default)")
    ap.add_argument("--guidance", type=float, default=6.0, help="CFG scale (Cosmos3OmniPipeline's default)")
    ap.add_argument("--shift", type=float, default=10.0, help="flow shift of the UniPC scheduler")
    ap.add_argument("--warmup", type=int, default=1, help="requests before timing (the first one captures)")
    ap.add_argument("--runs", type=int, default=5, help="timed requests per mode")
    ap.add_argument("--peer", choices=["none", "diffusers"], default="diffusers",
                    help="time diffusers' Cosmos3OmniPipeline first, on the same weights, in the same process")
    ap.add_argument("--peer-warmup", type=int, default=1, help="untimed peer requests")
    ap.add_argument("--peer-runs", type=int, default=5, help="timed peer requests")
    ap.add_argument("--attention", default="measure", choices=["measure", "cudnn", "fa4", "flash", "efficient"],
                    help="Generator attention kernel; measure: the fastest at the largest mode's shape")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                    help="torch.compile mode of the layer halves (autotuning takes minutes per new shape)")
    ap.add_argument("--epilogues", default="inductor", choices=EPILOGUES,
                    help="the Generator layer tail's GEMM epilogues (quack: needs quack-kernels, which comes with "
                         "flash-attn-4, and a Hopper or Blackwell GPU)")
    ap.add_argument("--all-rows", action="store_true",
                    help="the last layer on every row (EngineConfig.last_layer_read_rows off): the comparison for "
                         "the default, which skips an i2v request's conditioning frame there")
    t2v, transfer = LARGE_WORLD_MODES["t2v720"], LARGE_WORLD_MODES["transfer"]
    ap.add_argument("--t2v720-size", type=_height_width, default=t2v["size"], help="HEIGHTxWIDTH of t2v720")
    ap.add_argument("--t2v720-frames", type=int, default=t2v["num_frames"], help="frames of a t2v720 clip")
    ap.add_argument("--transfer-size", type=_height_width, default=transfer["size"], help="HEIGHTxWIDTH of transfer")
    ap.add_argument("--transfer-frames", type=int, default=transfer["num_frames"], help="frames of a transfer clip")
    ap.add_argument("--large-steps", type=int, default=4, help="our steps per t2v720 / transfer request")
    ap.add_argument("--large-runs", type=int, default=2, help="timed t2v720 / transfer requests after one warm-up")
    ap.add_argument("--peer-steps", type=int, default=3, help="the peer's steps in t2v720 / transfer (its later "
                    "steps are timed)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="t2v720 / transfer: the share of attention in a step (torch.profiler over one request)")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--out", default="bench/results/latency", help="folder of the result JSON files and the chart")


def _kernels(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", nargs="+", default=["edge", "nano"], choices=["edge", "nano", "super"],
                    help="model sizes whose call sites are timed")
    ap.add_argument("--tokens", type=int, default=GENERATOR_TOKENS, help="GEMM rows (Generator tokens, both branches)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per kernel")
    ap.add_argument("--sweep", action="store_true", help="time every tile configuration of SWEEP_TILES, not only "
                    "quack's default")
    ap.add_argument("--out", default="bench/results/kernels", help="folder of the result JSON file")


def _parallel(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="nano",
                    help="registered size with random weights (edge, nano, super, tiny-qwen)")
    ap.add_argument("--parallel", choices=["cfg", "tp"], default="cfg",
                    help="cfg = one CFG branch per GPU; tp = every layer split across --gpus GPUs")
    ap.add_argument("--gpus", type=int, default=2, help="ranks (cfg: exactly 2)")
    ap.add_argument("--baseline", action="store_true", help="first time the same policy on one GPU (rank 0's)")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed requests")
    ap.add_argument("--runs", type=int, default=30, help="timed requests")
    _smoke_arguments(ap)
    ap.add_argument("--attention", default=None, help="Generator attention backend (default: cudnn on CUDA)")
    ap.add_argument("--no-graph", action="store_true", help="E4 instead of E5 (no whole-loop CUDA graph)")
    ap.add_argument("--serve-seconds", type=float, default=0.0,
                    help="also serve the parallel engine on loopback and time one websocket lane this long (0: off)")
    ap.add_argument("--device", default="cuda", help="cuda (one GPU per rank, NCCL) or cpu (gloo, tiny models)")
    ap.add_argument("--out", default="bench/results/latency", help="folder of the result JSON files")
    world = ap.add_argument_group("world generation (--world): t2v denoising steps per second over 1-8 GPUs; "
                                  "see docs/world.md")
    world.add_argument("--world", action="store_true",
                       help="time world generation (text -> video) in the layouts --layouts at --gpu-counts instead "
                            "of policy requests; --steps steps per request")
    world.add_argument("--layouts", default="cfg,ulysses,cfg+ulysses",
                       help="of cfg (2 GPUs), ulysses (2+), cfg+ulysses (4+, even), comma-separated")
    world.add_argument("--gpu-counts", default="1,2,4,8", help="GPU counts, comma-separated (1: one GPU, the baseline)")
    world.add_argument("--size", default="1280x720", help="WxH of the clip")
    world.add_argument("--frames", type=int, default=189, help="frames of the clip (4k+1)")
    world.add_argument("--world-runs", type=int, default=2, help="timed requests per layout (after one warm-up)")


def _load(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="ws://127.0.0.1:8000", help="loopback ws:// URL of a `wamrt serve`")
    ap.add_argument("--lanes", type=int, default=1, help=f"concurrent closed-loop lanes (1..{MAX_LANES})")
    ap.add_argument("--seconds", type=float, default=None,
                    help=f"measured duration (max {MAX_SECONDS:.0f}); default 10, or with --requests the cap")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="measure N requests (ceil(N / lanes) per lane) instead of a duration; --seconds caps it "
                         f"(default {MAX_SECONDS:.0f})")
    ap.add_argument("--prompts", default="fixed", metavar="|".join(PROMPT_SETS) + "|FILE",
                    help="instructions the lanes cycle through, each lane from its own offset: fixed = the sample "
                         "instruction; mixed = twelve built-in robot instructions of different token lengths; "
                         "fleet = nine of 1 to 254 tokens; FILE = one instruction per line")
    ap.add_argument("--graph-wait", type=float, default=600.0, metavar="SECONDS",
                    help="before the row, wait (at most this long) until the server's background CUDA-graph captures "
                         "are done (its /readyz says so), so that the row measures the server's steady state; 0: "
                         "measure at once")
    ap.add_argument("--warmup-requests", type=int, default=1, metavar="N",
                    help="unmeasured requests per lane first; with several prompts (and N >= 1) the lanes also send "
                         "every prompt once between them, so no measured request pays a first prefill")
    ap.add_argument("--steps", type=int, default=None, help="per-request params.num_steps (default: the server's)")
    ap.add_argument("--api-key", default=None, help="for a server started with --api-key")
    ap.add_argument("--model", default="", help="label for the result file (e.g. nano)")
    ap.add_argument("--out", default=None, help="write the kind: load JSON result here (default: print only)")
    ap.add_argument("--baseline", default=None,
                    help="a 1-lane result file of the same model: adds requests/s, efficiency and tail ratios")
    ap.add_argument("--background-generation", type=_background_fields, default=None, metavar="FIELDS",
                    help="while the lanes run, submit this world-generation job to the server's /v1/videos/sync "
                         "back to back: a JSON object of vLLM-Omni multipart fields, e.g. '{\"prompt\": \"a robot "
                         "arm\", \"size\": \"832x480\", \"num_frames\": \"33\", \"num_inference_steps\": \"35\", "
                         "\"guidance_scale\": \"6\", \"input_reference\": \"@sample\"}' (@sample = a built-in "
                         "picture, @PATH = a file); adds a background_generation object to the result")
    ap.add_argument("--generation-warmup", type=int, default=1, metavar="N",
                    help="with --background-generation: jobs run alone, unmeasured, before the lanes start (a GPU "
                         "server compiles and captures a job shape's graphs in its first job); 0 when an earlier row "
                         "already ran the same job on this server")
    ap.add_argument("--lane-period-ms", type=float, default=0.0, metavar="MS",
                    help="each lane asks at most once per MS, as a robot does that executes a chunk before it asks "
                         "for the next (2133 = 32 steps at 15 Hz); default 0: back to back, the device never idle")


def _waterfall(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("files", nargs="+", help="result JSON files, in bar order; FILE::NOTE adds NOTE as the bar "
                    "label's last line")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="", help="chart title")
    ap.add_argument("--peer-from", type=int, help="index of the file whose diffusers peer is drawn (default: the "
                    "first file that has one)")


def _timeline(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("traces", nargs="+", help="Chrome traces written by `wamrt bench latency --trace`")
    ap.add_argument("--split-us", type=float, default=100.0, help="a gap at least this long starts a new segment")


def _decode(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--size", default="nano", choices=MODELS, help="registered model size (random weights)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny-qwen, fp32, few tokens, no graphs")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of every row")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each sequence decodes (timed pass)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    ap.add_argument("--prefill-reps", type=int, default=5, help="timed prefills (after one warm-up)")
    ap.add_argument("--hf-tokens", type=int, default=64,
                    help="transformers' generate baseline: tokens per timed run (0: skip it)")
    ap.add_argument("--no-fused", dest="fused", action="store_false",
                    help="skip the graph rows with the layers' small kernels compiled (reasoner/fused.py)")
    ap.add_argument("--no-fuse-weights", dest="fuse_weights", action="store_false",
                    help="skip the last rows, with one matrix for q/k/v and one for gate/up (engine/fuse.py "
                         "fuse_reasoner; graph + fused layers on CUDA, eager on the CPU)")
    ap.add_argument("--fused-modes", nargs="*", default=[],
                    choices=["max-autotune-no-cudagraphs", "coordinate-descent"],
                    help="batch-1 rows of the fused layers over the fused matrices in these compile modes too (CUDA; "
                         "max-autotune times Triton matmul templates per shape: minutes at Nano)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="CUDA: profile this many batch-1 graph steps of the fused layers (last, over the fused "
                         "matrices unless --no-fuse-weights): device time by kernel kind, idle time, top kernels")
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode"), help="result folder")


def _prefix_cost(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="edge", choices=MODELS, help="registered size (random weights; tiny-*: CPU)")
    ap.add_argument("--delays", type=int, nargs="+", default=[3, 10],
                    help="prefix rows d (issue 41: Edge bf16 runs at d = 3, Nano bf16 at d = 10 at 15 Hz)")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default: the DROID server's, 4)")
    ap.add_argument("--layers", type=int, default=None, help="build only this many layers (a dry run)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed requests per mode before the timed ones")
    ap.add_argument("--runs", type=int, default=10, help="timed requests per mode and delay")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/latency"), help="result folder")


def _latent_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected B,C,T,H,W, got {text!r}") from e
    if len(shape) != 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected five positive sizes B,C,T,H,W, got {text!r}")
    return shape


def _vae(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--stages", type=_rows, default=["encode", "decode"],
                    help="comma-separated: encode (the policy's frame-0 encode at the DROID canvas), decode (the "
                         "world decode at --latent-shape)")
    ap.add_argument("--encode-runs", type=int, default=30, help="timed encodes per variant (after one untimed)")
    ap.add_argument("--tier", default="480", help="the encoded canvas's resolution tier (480: the DROID policy's; 256: "
                    "a smaller bucket for smoke tests)")
    ap.add_argument("--decode-runs", type=int, default=5, help="timed decodes per variant (after one untimed)")
    ap.add_argument("--latent-shape", type=_latent_shape, default=(1, 48, 9, 30, 52),
                    help="B,C,T,H,W of the decode's normalised latents (default: 33 frames of 480x832)")
    ap.add_argument("--tiny-vae", action="store_true", help="tiny VAE instead of the Wan2.2 size (smoke tests)")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--out", default="bench/results/latency", help="folder of vae-encode.json / vae-decode.json")


def _host_timeline(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="edge", choices=MODELS, help="tiny-* run on the CPU in seconds (smoke tests)")
    _smoke_arguments(ap)
    ap.add_argument("--row", default="E7", help="a `wamrt bench latency` row, exact (E5, ...; 4 steps) or lossy "
                    "(E7, ...: its recipe and steps)")
    ap.add_argument("--attention", default=None, choices=["cudnn", "fa4", "flash", "efficient", "auto"],
                    help="Generator attention (default: fa4 where installed, else cudnn; auto off CUDA)")
    ap.add_argument("--engine-flags", type=_json_object, default={}, metavar="JSON",
                    help="more EngineConfig fields on top of the row's, e.g. '{\"overlap_encode\": false}'")
    ap.add_argument("--warmup", type=int, default=5, help="untimed requests first (compiles, captures)")
    ap.add_argument("--runs", type=int, default=20, help="timed requests, then as many under cProfile")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--out", default="bench/results/latency", help="folder of host-timeline-MODEL-ROW.json and "
                    "host-profile-MODEL-ROW.txt")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
def _soak(ap: argparse.ArgumentParser) -> None:
    # Defaults repeat bench.soak's (DEFAULT_SERVE); the runner is imported when the command runs.
    serve = "--model tiny-world --device cpu --steps 1 --max-batch 4"
    ap.add_argument("--requests", type=int, default=10_000, help="requests of the mixed phase")
    ap.add_argument("--baseline", type=int, default=None,
                    help="requests of the baseline (the mix without its bad kinds; default: a tenth of --requests, "
                         ">= 100)")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients (1-8)")
    ap.add_argument("--serve", default=serve, metavar="FLAGS",
                    help=f"`wamrt serve` flags of the server under test (default: {serve})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' draws from the mix")
    ap.add_argument("--out", default=None, help="write the kind: soak JSON result here")
