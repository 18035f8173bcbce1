"""`wamrt bench host-timeline`: where a warm request's host time goes, against what the GPU does meanwhile.

Builds the engine of one `wamrt bench latency` row (default E7: gen-fp8, 2 steps) on random weights, warms it, then
times `--runs` requests with two clocks on one axis, both in ms from the request's start:
* wall marks (host): entering and leaving the VAE encode call, `finish_droid`, `_sequences` and `_denoise`, each
  CUDA graph replay call (the VAE's first, then the denoise loop's), and the return;
* GPU marks (CUDA only): CUDA events recorded just before and after each replay on the stream it runs on, and one at
  the start (the GPU is idle then: the previous request ended in a sync, so that event fires when the host records
  it).
`denoise_wait_for_host_ms` is how long the GPU sat between the VAE graph's end and the denoise graph's start: the host
work on the critical path. Then a cProfile of as many requests again (cumulative and own time) names that work.
Writes host-timeline-MODEL-ROW.json and host-profile-MODEL-ROW.txt. On the CPU (tiny-* models) there are no graphs:
the wall marks and the profile only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import fields
from pathlib import Path

import torch

from ..provenance import environment
from .catalog import ROWS
from .stats import median_stages, summarize


class Marks:
    """One request's wall marks (ms since its start) and GPU events."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start()

    def start(self) -> None:
        self.t0, self.wall, self.events, self.replays = time.perf_counter(), {}, {}, 0
        self.event("start")

    def mark(self, name: str) -> None:
        self.wall.setdefault(name, 1e3 * (time.perf_counter() - self.t0))

    def event(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()  # the current stream: inside the encode's side-stream block that is the side stream
            self.events[name] = e

    def gpu(self) -> dict[str, float]:
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        return {k: self.events["start"].elapsed_time(e) for k, e in self.events.items() if k != "start"}


@contextmanager
def instrumented(marks: Marks) -> Iterator[None]:
    """The engine's stages and every CUDA graph replay leave marks while inside; all is as it was after."""
    from ..engine import (
        Engine,
        admission,  # where the engine calls the encode and finish_droid
    )

    with ExitStack() as undo:
        def patch(owner, name: str, before: str, after: str) -> None:
            fn = getattr(owner, name)

            def wrapped(*a, **kw):
                marks.mark(before)
                out = fn(*a, **kw)
                marks.mark(after)
                return out

            setattr(owner, name, wrapped)
            undo.callback(setattr, owner, name, fn)

        replay = torch.cuda.CUDAGraph.replay

        def timed_replay(graph):
            name = "vae" if marks.replays == 0 else "denoise" if marks.replays == 1 else f"graph{marks.replays}"
            marks.replays += 1
            marks.mark(f"{name}_replay_call")
            marks.event(f"{name}_gpu_start")
            replay(graph)
            marks.event(f"{name}_gpu_end")
            marks.mark(f"{name}_replay_returned")

        torch.cuda.CUDAGraph.replay = timed_replay
        undo.callback(setattr, torch.cuda.CUDAGraph, "replay", replay)
        patch(admission, "encode_canvases", "encode_call", "encode_returned")
        patch(admission, "finish_droid", "finish_droid_call", "finish_droid_returned")
        patch(Engine, "_sequences", "sequences_call", "sequences_returned")
        patch(Engine, "_denoise", "denoise_call", "denoise_returned")
        yield


def check_row(row: str) -> None:
    from .lossy import LOSSY_ROWS

    if row not in ROWS and row not in LOSSY_ROWS:
        raise SystemExit(f"--row: unknown {row!r}; known: {[*ROWS, *LOSSY_ROWS]}")


def row_settings(row: str, policy) -> tuple[int, str, tuple[float, float] | None, dict]:
    """(steps, recipe, guidance interval, EngineConfig flags) of a `wamrt bench latency` row (exact: 4 steps)."""
    from .lossy import LOSSY_ROWS, first_step_interval

    if row in ROWS:
        return 4, "bf16", None, dict(ROWS[row][1])
    _, steps, recipe, first_only, flags = LOSSY_ROWS[row]
    return steps, recipe, first_step_interval(policy, steps) if first_only else None, dict(flags)


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]} if rows and rows[0] else {}


def summary(wall: dict[str, float], gpu: dict[str, float], waits: list[float]) -> dict[str, float]:
    """The critical path in a few numbers (medians, ms); the GPU ones where the request replayed its graphs."""
    out = {"host_before_encode_call_ms": wall["encode_call"],
           "encode_call_to_denoise_call_ms": wall["denoise_call"] - wall["encode_call"],
           "after_denoise_returned_ms": wall["returned"] - wall["denoise_returned"]}
    if {"vae_gpu_end", "denoise_gpu_start"} <= set(gpu):
        out.update(denoise_wait_for_host_ms=statistics.median(waits),
                   host_from_vae_call_to_denoise_call_ms=wall["denoise_replay_call"] - wall["vae_replay_call"],
                   vae_graph_gpu_ms=gpu["vae_gpu_end"] - gpu["vae_gpu_start"],
                   denoise_graph_gpu_ms=gpu["denoise_gpu_end"] - gpu["denoise_gpu_start"],
                   after_denoise_graph_ms=wall["returned"] - gpu["denoise_gpu_end"])
    return {k: round(v, 3) for k, v in out.items()}


def _command(args: argparse.Namespace, attention: str) -> str:
    smoke = (f" --layers {args.layers}" if args.layers else "") + (" --tiny-vae" if args.tiny_vae else "")
    return (f"wamrt bench host-timeline --model {args.model}{smoke} --row {args.row} --attention {attention} "
            f"--engine-flags '{json.dumps(args.engine_flags)}' --warmup {args.warmup} --runs {args.runs}")


def run(args: argparse.Namespace) -> int:
    from ..engine import Engine
    from ..engine.config import EngineConfig
    from ..ops.attention import fa4_available
    from ..pipeline.policy import random_policy
    from ..quant import quantize_model
    from ..sample import sample_observation
    from .rows import engine_config

    check_row(args.row)  # before the (large) build
    unknown = sorted(set(args.engine_flags) - {f.name for f in fields(EngineConfig)})
    if unknown:
        raise SystemExit(f"--engine-flags: unknown EngineConfig fields {unknown}")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    policy = random_policy(args.model, dev, dtype, layers=args.layers, tiny_vae=args.tiny_vae)
    steps, recipe, interval, flags = row_settings(args.row, policy)
    if recipe != "bf16":
        quantize_model(policy.model, recipe)
    attention = args.attention or ("auto" if dev.type != "cuda" else "fa4" if fa4_available(dev) else "cudnn")
    flags = {"attention": attention, **flags, **args.engine_flags}
    engine = Engine.from_policy(policy, engine_config(dev, **flags))
    overrides = {"steps": steps, **({"guidance_interval": interval} if interval else {})}
    observations = [sample_observation(i) for i in range(args.warmup + args.runs)]
    for obs in observations[:args.warmup]:
        engine.infer(obs, **overrides)

    marks = Marks(dev)
    walls, gpus, totals, stages = [], [], [], []
    prof = cProfile.Profile()
    with instrumented(marks):
        for obs in observations[args.warmup:]:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            marks.start()
            chunk = engine.infer(obs, **overrides)
            marks.mark("returned")
            walls.append(dict(marks.wall))
            gpus.append(marks.gpu())
            totals.append(marks.wall["returned"])
            stages.append(chunk.timings_ms)
        prof.enable()
        for obs in observations[args.warmup:]:
            marks.start()
            engine.infer(obs, **overrides)
        prof.disable()
    wall, gpu = _medians(walls), _medians(gpus)
    waits = [g["denoise_gpu_start"] - g["vae_gpu_end"] for g in gpus if {"vae_gpu_end", "denoise_gpu_start"} <= set(g)]
    result = {
        "kind": "host-timeline", "command": _command(args, attention), **environment(), "model": args.model,
        "row": args.row, "recipe": recipe, "steps": steps, "guidance_interval": interval, "engine": flags,
        "weights": "random", "warmup": args.warmup, "runs": args.runs, "total": summarize(totals),
        "stages_ms_p50": median_stages(stages), "wall_ms_p50": wall, "gpu_ms_p50": gpu,
        "summary": summary(wall, gpu, waits),
    }
    print(json.dumps({k: result[k] for k in ("wall_ms_p50", "gpu_ms_p50", "summary")}, indent=1), flush=True)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-profile-{args.model}-{args.row}.txt").write_text(text.getvalue())
    path = out / f"host-timeline-{args.model}-{args.row}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(text.getvalue()[:6000])
    print(json.dumps({"out": str(path), "total_p50_ms": result["total"]["p50_ms"]}), flush=True)
    return 0
