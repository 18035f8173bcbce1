"""Issue 14 moonshot: where a warm request's host time goes, against what the GPU is doing meanwhile.

    python3 scripts/host_timeline.py --model edge --recipe gen-fp8 --steps 2 --out DIR [--attention fa4]

Builds the engine of a waterfall row (E7: gen-fp8, 2 steps; E5: bf16, 4 steps), warms it, then times `--runs` requests
with two clocks on one axis, both relative to the request's start:
* wall marks (host): entering the VAE encode, each CUDA graph replay call (the VAE's first, then the denoise loop's),
  leaving `finish_droid`, entering `_denoise`, and the return;
* GPU marks: CUDA events recorded just before and after each replay on the stream it runs on, and one at the start
  (the GPU is idle then: the previous request ended in a sync, so that event fires when the host records it).
`denoise_wait_for_host_ms` is how long the GPU sat between the VAE graph's end and the denoise graph's start: the
host work on the critical path. Then a cProfile of the same requests (cumulative and own time) names that work.
Writes host-timeline-<model>-<row>.json and the profile text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from wamrt.bench.rows import engine_config  # noqa: E402
from wamrt.engine import Engine  # noqa: E402
from wamrt.engine import engine as engine_module  # noqa: E402
from wamrt.pipeline.policy import random_policy  # noqa: E402
from wamrt.quant import quantize_model  # noqa: E402
from wamrt.sample import sample_observation  # noqa: E402


class Marks:
    """One request's wall marks (ms since its start) and GPU events."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.wall: dict[str, float] = {}
        self.events: dict[str, torch.cuda.Event] = {}
        self.replays = 0

    def start(self) -> None:
        self.t0, self.wall, self.events, self.replays = time.perf_counter(), {}, {}, 0
        self.event("start")

    def mark(self, name: str) -> None:
        self.wall.setdefault(name, 1e3 * (time.perf_counter() - self.t0))

    def event(self, name: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()  # the current stream: inside the encode's `with torch.cuda.stream(...)` that is the side stream
        self.events[name] = e

    def gpu(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {k: self.events["start"].elapsed_time(e) for k, e in self.events.items() if k != "start"}


def instrument(marks: Marks) -> None:
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(self):
        name = "vae" if marks.replays == 0 else "denoise" if marks.replays == 1 else f"graph{marks.replays}"
        marks.replays += 1
        marks.mark(f"{name}_replay_call")
        marks.event(f"{name}_gpu_start")
        replay(self)
        marks.event(f"{name}_gpu_end")
        marks.mark(f"{name}_replay_returned")

    torch.cuda.CUDAGraph.replay = timed_replay

    def wrap(module, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(module, name)

        def wrapped(*a, **kw):
            if before:
                marks.mark(before)
            out = fn(*a, **kw)
            if after:
                marks.mark(after)
            return out

        setattr(module, name, wrapped)

    wrap(engine_module, "encode_canvases", "encode_call", "encode_returned")
    wrap(engine_module, "finish_droid", "finish_droid_call", "finish_droid_returned")
    wrap(Engine, "_denoise", "denoise_call", "denoise_returned")
    wrap(Engine, "_sequences", "sequences_call", "sequences_returned")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="edge")
    ap.add_argument("--recipe", default="gen-fp8", choices=["bf16", "gen-fp8"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--attention", default="cudnn")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--flags", default="{}", help="more EngineConfig fields, JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    policy = random_policy(args.model, dev, torch.bfloat16)
    if args.recipe == "gen-fp8":
        quantize_model(policy.model, "gen-fp8")
    flags = {"attention": args.attention, **json.loads(args.flags)}
    engine = Engine.from_policy(policy, engine_config(dev, **flags))
    observations = [sample_observation(i) for i in range(args.warmup + args.runs)]
    for obs in observations[: args.warmup]:
        engine.infer(obs, steps=args.steps)
    marks = Marks()
    instrument(marks)
    walls, gpus, totals, stages = [], [], [], []
    for obs in observations[args.warmup:]:
        torch.cuda.synchronize()
        marks.start()
        chunk = engine.infer(obs, steps=args.steps)
        marks.mark("returned")
        walls.append(dict(marks.wall))
        gpus.append(marks.gpu())
        totals.append(marks.wall["returned"])
        stages.append(chunk.timings_ms)

    def medians(rows: list[dict]) -> dict[str, float]:
        return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}

    wall, gpu = medians(walls), medians(gpus)
    waits = [g["denoise_gpu_start"] - g["vae_gpu_end"] for g in gpus]
    summary = {
        "denoise_wait_for_host_ms": round(statistics.median(waits), 3),
        "host_from_vae_call_to_denoise_call_ms": round(wall["denoise_replay_call"] - wall["vae_replay_call"], 3),
        "vae_graph_gpu_ms": round(gpu["vae_gpu_end"] - gpu["vae_gpu_start"], 3),
        "denoise_graph_gpu_ms": round(gpu["denoise_gpu_end"] - gpu["denoise_gpu_start"], 3),
        "after_denoise_graph_ms": round(wall["returned"] - gpu["denoise_gpu_end"], 3),
    }
    print(json.dumps({"wall_ms": wall, "gpu_ms": gpu, "summary": summary}, indent=1), flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for obs in observations[args.warmup:]:
        marks.start()
        engine.infer(obs, steps=args.steps)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    row = f"{args.recipe}-s{args.steps}"
    with open(os.path.join(args.out, f"host-profile-{args.model}-{row}.txt"), "w") as f:
        f.write(text.getvalue())
    sha = os.environ.get("WAMRT_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip()
    record = {"kind": "host-timeline", "command": " ".join(sys.argv), "git_sha": sha,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
              "model": args.model, "recipe": args.recipe, "steps": args.steps, "engine": flags, "runs": args.runs,
              "total_ms_p50": round(statistics.median(totals), 3), "stages_ms_p50": medians(stages),
              "wall_ms_p50": wall, "gpu_ms_p50": gpu, "summary": summary}
    with open(os.path.join(args.out, f"host-timeline-{args.model}-{row}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
