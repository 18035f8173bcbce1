"""The delay mode on the command line: flags of `wamrt rollout` / `wamrt eval gate`, and `wamrt eval grid`.

`--delay-steps N` or `--latency-ms P50[,P99]|FILE` (or `--strategy` alone, d = 0) runs episodes on the robot's
clock (`wamrt.eval.realtime`): a request answered d control steps after its observation, the arm executing the
committed rows meanwhile. `--wall-clock` (with a server URL) runs the same runner at 15 Hz in real time instead.
A gate SPEC may set its own `strategy=`, `delay_steps=`, `latency_ms=P50/P99` and `prefix_mode=`, so each side of
a gate runs at its own latency.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

# The runner's names, repeated so that building the parser imports no numpy (a test holds them equal).
STRATEGIES = ("sync", "async", "blend", "prefix")
PREFIX_MODES = ("auto", "clean", "inpaint", "guided")
GRID_STRATEGY_NAMES = ("sync", "async", "blend", "prefix", "prefix-inpaint", "prefix-trained", "prefix-inpaint-seam",
                       "prefix-trained-seam", "prefix-guided")

# SPEC keys of the delay mode (cli.sim.parse_spec hands them here); latency_ms uses "/" (a "," separates keys).
REALTIME_SPEC_KEYS: dict[str, Any] = {
    "strategy": str,
    "delay_steps": int,
    "latency_ms": lambda v: v.replace("/", ","),
    "prefix_mode": str,
}


class RealtimeUsageError(ValueError):
    """A bad delay-mode flag or SPEC value (printed as a usage error, exit 2)."""


def add_delay_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("delay mode (the world keeps moving while the policy thinks; docs/realtime.md)")
    g.add_argument("--strategy", choices=STRATEGIES,
                   help="sync (hold while waiting), async (naive switch), blend (cross-fade), prefix (send the "
                        "committed rows); given alone: d = 0")
    g.add_argument("--delay-steps", type=int, metavar="D", help="every request answered D control steps later")
    g.add_argument("--latency-ms", metavar="P50[,P99]|FILE",
                   help="per-request latency (ms; log-normal through P50 and P99, seeded), or a `wamrt bench load` / "
                        "`latency` result file; d = ceil(latency / 66.7 ms) at 15 Hz")
    g.add_argument("--prefix-mode", choices=PREFIX_MODES, default="auto",
                   help="action_prefix_mode of prefix requests (default auto: the checkpoint decides)")
    add_seam_argument(g)
    g.add_argument("--wall-clock", action="store_true",
                   help="real time: each lane runs the 15 Hz client against the --url server (real latency)")
    g.add_argument("--actuation-noise", type=float, default=0.0, metavar="RAD",
                   help="seeded OU noise (std, rad) on every executed joint target (default 0)")
    add_reflex_argument(g)


def add_seam_argument(ap: Any) -> None:
    """The runner's execution options: the prefix seam and the gripper rounding."""
    ap.add_argument("--seam-rows", type=int, default=0, metavar="K",
                    help="prefix strategy: cross-fade the reply's first K rows after the prefix from the old plan "
                         "(default 0: switch at the prefix's end)")
    ap.add_argument("--binary-gripper", action="store_true",
                    help="round every gripper command to 0 or 1 at 0.5, as openpi's DROID client does (default: "
                         "run the policy's value)")


def add_reflex_argument(ap: Any) -> None:
    ap.add_argument("--reflexes", choices=["task", "on", "off"], default="task",
                    help="protective stops on commanded joint jumps (docs/realtime.md; default: the task's, on for "
                         "turntable)")


def env_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """PandaEnv options from the run flags (actuation noise, reflexes)."""
    out: dict[str, Any] = {}
    if getattr(args, "actuation_noise", 0.0):
        out["actuation_noise"] = args.actuation_noise
    if getattr(args, "reflexes", "task") != "task":
        out["reflexes"] = args.reflexes == "on"
    return out


def delay_settings(args: argparse.Namespace, spec: dict[str, Any] | None = None) -> Any:
    """The run's RealtimeSettings, or None for the lock-step rollout (no delay flag, no SPEC key)."""
    from ..client.clocks import LatencyModel
    from ..eval.realtime import RealtimeSettings

    spec = spec or {}
    strategy = spec.get("strategy", args.strategy)
    steps = spec.get("delay_steps", args.delay_steps)
    latency = spec.get("latency_ms", args.latency_ms)
    if "delay_steps" in spec and "latency_ms" not in spec:
        latency = None
    if "latency_ms" in spec and "delay_steps" not in spec:
        steps = None
    wall = bool(getattr(args, "wall_clock", False))
    binary = bool(spec.get("binary_gripper", getattr(args, "binary_gripper", False)))
    if strategy is None and steps is None and latency is None and not wall and not binary:
        return None  # lock-step (a rounded gripper runs through the runner at d = 0 instead)
    if strategy is not None and strategy not in STRATEGIES:
        raise RealtimeUsageError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    mode = spec.get("prefix_mode", args.prefix_mode)
    if mode not in PREFIX_MODES:
        raise RealtimeUsageError(f"prefix_mode must be one of {', '.join(PREFIX_MODES)}, got {mode!r}")
    if steps is not None and latency is not None:
        raise RealtimeUsageError("give --delay-steps or --latency-ms, not both")
    if wall and (steps is not None or latency is not None):
        raise RealtimeUsageError("--wall-clock measures the real latency: drop --delay-steps / --latency-ms")
    try:
        model = (LatencyModel.parse(str(latency)) if latency is not None
                 else LatencyModel(steps=int(steps or 0)))
    except ValueError as e:
        raise RealtimeUsageError(str(e)) from e
    seam = int(spec.get("seam_rows", getattr(args, "seam_rows", 0)))
    if seam < 0:
        raise RealtimeUsageError(f"seam_rows must be >= 0, got {seam}")
    return RealtimeSettings(strategy or "async", model, mode, args.execute_steps, wall, seam, binary)


def result_fields(settings: Any) -> dict[str, Any]:
    """Top-level fields of a delay-mode result file (the bars read these)."""
    if settings is None:
        return {}
    out: dict[str, Any] = {"strategy": settings.strategy, "clock": "wall" if settings.wall_clock else "simulated"}
    if not settings.wall_clock:
        out["delay_steps"] = settings.latency.nominal_steps()
        if settings.latency.p50_ms is not None:
            out["latency_ms"] = settings.latency.describe()["latency_ms"]
    if settings.strategy == "prefix":
        out["prefix_mode"] = settings.prefix_mode
    return out


def summary_line(results: Any) -> str:
    from ..eval.realtime import summarize_realtime

    s = summarize_realtime(results)
    if not s:
        return "delay mode: no episodes"

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return (f"delay mode: {s['requests']} requests, delay mean {f(s['delay_steps_mean'], '.2f')} steps, "
            f"stood still {s['stall_fraction']:.1%} of steps ({s['stalled_after_first_chunk']} after an episode's "
            f"first chunk), steps to success {f(s['steps_to_success_mean'], '.1f')}, "
            f"jerk at chunk boundaries {f(s['jerk_boundary_mean'], '.0f')} vs inside {f(s['jerk_inside_mean'], '.0f')} "
            f"rad/s^3")


# ---- wamrt eval grid ------------------------------------------------------------------------------------------
def add_grid_command(ev: argparse._SubParsersAction) -> None:
    g = ev.add_parser("grid", help="success against delay for every strategy: one result file per cell, a table "
                      "with paired McNemar p and a chart (docs/realtime.md)")
    g.add_argument("--tasks", default="pick_place,turntable", help="comma-separated simulator tasks")
    g.add_argument("--delays", default="0,1,3,6,10,14", help="d in control steps (15 Hz), comma-separated")
    g.add_argument("--strategies", default="sync,async,blend,prefix-inpaint,prefix-trained",
                   help="of " + ", ".join(GRID_STRATEGY_NAMES) + " (prefix: auto mode)")
    g.add_argument("--episodes", type=int, default=200, help="episodes per cell, one per seed (paired across cells)")
    g.add_argument("--seed0", type=int, default=0, help="episode seeds are seed0 .. seed0+episodes-1")
    g.add_argument("--policy", required=True,
                   help="checkpoint folder, built-in name, ws:// URL of a `wamrt serve`, or 'expert' (the scripted "
                        "expert as a chunk planner, on privileged state)")
    g.add_argument("--trained-policy", help="the checkpoint trained with action prefixes (prefix-trained cells; "
                   "folder or URL). Without it those cells are left out")
    g.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="cell files, summary.md, summary.json and the chart go here")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="simulator processes (default: one per core but one)")
    g.add_argument("--lanes", type=int, default=8, help="episodes side by side in each worker (default 8)")
    g.add_argument("--max-batch", type=int, default=64, help="requests per policy call (default 64)")
    g.add_argument("--execute-steps", type=int, default=8, help="request period in rows (default 8)")
    add_seam_argument(g)
    g.add_argument("--max-steps", type=int, help="episode step limit (default: the task's)")
    g.add_argument("--budget-s", type=float, help="start no new episode after this many seconds")
    g.add_argument("--priority-delays", default="10", help="delays run first after d = 0 (default 10)")
    g.add_argument("--actuation-noise", type=float, default=0.0, metavar="RAD",
                   help="seeded OU noise (std, rad) on every executed joint target")
    add_reflex_argument(g)
    g.add_argument("--expert-turntable-rate", type=float, metavar="RAD_S",
                   help="--policy expert: plan as if the disc turned at this rate, not the episode's own (what a "
                        "policy seeing one frame cannot know; the task draws 0.35-0.55)")
    g.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    g.add_argument("--engine", choices=["auto", "eager", "fast"], default="auto",
                   help="in-process policies: the fast engine (auto: on CUDA) or the eager reference")
    g.add_argument("--batch-invariant", action="store_true",
                   help="fast engine: every request computed alone (bit-exact replays, slower)")
    g.add_argument("--steps", type=int, help="sampler steps (default: the policy's)")
    g.add_argument("--guidance-interval", type=int, nargs=2, metavar=("LO", "HI"),
                   help="CFG only where LO < t < HI (the lever 'guidance on the first step only': 937 1000 at 4 "
                        "steps, 833 1000 at 2; python -m wamrt.eval.levers)")
    g.add_argument("--record-dagger", type=Path, metavar="DIR",
                   help="also write every request of the policy with the scripted expert's chunk for it (its prefix, "
                        "then the expert's plan from where that prefix leaves the arm): training data for `wamrt "
                        "train fit --demos DIR`, one .npz per episode (eval/dagger.py)")
    g.add_argument("--api-key", help="for a server started with --api-key")
    g.add_argument("--resume", action="store_true",
                   help="skip the cells --out already holds complete for these seeds (a grid spread over device calls)")
    g.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild summary.md and the chart from the cell files in --out (a run cut short)")
    g.set_defaults(func=run_grid_command)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _backend(name: str, args: argparse.Namespace) -> tuple[Any, str, dict[str, Any]]:
    """(backend, gpu name, config) of one policy for the grid's batched calls."""
    from ..eval.grid import LocalBackend, RemoteBackend
    from ..eval.remote import is_url, server_metadata

    overrides: dict[str, Any] = {"steps": args.steps} if args.steps else {}
    if args.guidance_interval:
        overrides["guidance_interval"] = tuple(args.guidance_interval)
    if is_url(name) and overrides:  # the websocket requests carry no sampling fields: they would be ignored
        raise ValueError(f"--steps and --guidance-interval apply to in-process policies, not to {name}")
    if is_url(name):
        try:
            server = server_metadata(name, args.api_key)
        except (OSError, ValueError) as e:
            server = {"error": f"no metadata from the server: {e}"}
        return (RemoteBackend(name, connections=args.max_batch, api_key=args.api_key), str(server.get("gpu")),
                {"agent": "remote", "url": name, "server": server, **overrides})
    import torch

    from .. import load_policy

    policy = load_policy(name, device=args.device)
    quantization = getattr(policy, "quantization", None)  # a `wamrt quantize` artifact (the gen-fp8 lever)
    engine = "eager"
    if args.engine == "fast" or (args.engine == "auto" and policy.device.type == "cuda"):
        from ..engine import Engine, EngineConfig
        from ..serving.config import ServeConfig

        settings = ServeConfig(batch_invariant=args.batch_invariant).engine_settings(str(policy.device))
        # No torch.compile: for a 7.7 M-parameter policy the CUDA graphs carry the speed, and compiling two
        # checkpoints would cost a minute of a ~9-minute device call.
        policy = Engine.from_policy(policy, EngineConfig(**{**settings, "compile": False}))
        engine = "fast" + (" (isolated requests)" if args.batch_invariant else "")
    gpu = torch.cuda.get_device_name(policy.device) if policy.device.type == "cuda" else "cpu"
    backend = LocalBackend(policy, **overrides)
    canvases = "simulator processes, 1 torch thread" if backend.host_contract is not None else "policy process"
    return backend, gpu, {"agent": "policy", "model": name, "engine": engine, "device": str(policy.device),
                          "canvases_composed_in": canvases, **overrides,
                          **({"quantization": quantization} if quantization else {})}


def _warm_up(backend: Any, task: str, batch: int) -> None:
    """Full batches at max_batch, then halves down to 8, before the run: a fast engine captures a graph at each
    size, and a batch replays the smallest captured graph that fits it (spare rows), so no capture lands in the run
    and a small batch does not pay for a large one's rows."""
    from ..sim.droid import droid_observation
    from ..sim.env import PandaEnv

    with PandaEnv(task) as env:
        obs = droid_observation(env.reset(0))
    size = batch
    while True:
        backend.infer_batch([obs] * size, list(range(size)))
        if size <= 8:
            break
        size = max(8, size // 2)


def run_grid_command(args: argparse.Namespace) -> int:
    from .sim import _error, _sim_problem

    if problem := _sim_problem():
        return _error(problem)
    from ..eval.grid import Cell, plan_cells, print_progress, run_grid
    from ..eval.grid_report import cell_result, write_grid
    from ..eval.results import write_result
    from ..provenance import git_sha
    from ..sim.tasks import TASKS

    tasks, strategies = _csv(args.tasks), _csv(args.strategies)
    try:
        delays = [int(d) for d in _csv(args.delays)]
        priority = [int(d) for d in _csv(args.priority_delays)]
    except ValueError:
        return _error("--delays and --priority-delays are comma-separated integers")
    if args.report_only:
        from ..eval.grid_report import load_cells

        files = load_cells(args.out)
        if not files:
            return _error(f"no grid cell files in {args.out}")
        cells = list(files)
        path, _ = write_grid(args.out, cells, files, strategies, delays,
                             {"policy": next(iter(files.values())).get("policy"), "command": "(report of cell files)",
                              "episodes": max(f["episodes"] for f in files.values())})
        print(path.read_text())
        return 0
    if unknown := [t for t in tasks if t not in TASKS]:
        return _error(f"unknown tasks {unknown} (tasks: {', '.join(TASKS)})")
    if args.episodes < 1 or args.workers < 1 or args.lanes < 1 or args.max_batch < 1:
        return _error("--episodes, --workers, --lanes and --max-batch must be >= 1")
    if args.guidance_interval and not args.guidance_interval[0] < args.guidance_interval[1]:
        return _error(f"--guidance-interval needs LO < HI, got {args.guidance_interval}")
    expert = args.policy == "expert"
    if args.expert_turntable_rate is not None and not expert:
        return _error("--expert-turntable-rate is for --policy expert")
    if args.expert_turntable_rate is not None and (still := [t for t in tasks if not TASKS[t].turntable]):
        return _error(f"--expert-turntable-rate: {', '.join(still)} has no turntable (--tasks turntable)")
    needs_trained = [s for s in strategies if s in GRID_STRATEGY_NAMES and _strategy_policy(s) == "trained"]
    if needs_trained and not args.trained_policy and not expert:
        strategies = [s for s in strategies if s not in needs_trained]
        if not strategies:  # nothing would run (and the report of no cells would fail on its empty chart)
            return _error(f"--strategies: {', '.join(needs_trained)} needs --trained-policy (a checkpoint trained "
                          "with action prefixes), and no other strategy was asked for")
        print(f"note: no --trained-policy: the {', '.join(needs_trained)} cells are left out", file=sys.stderr)
    try:
        cells = plan_cells(tasks, delays, strategies, priority)
    except ValueError as e:
        return _error(str(e))
    if expert:  # the planner honours every prefix mode exactly: prefix-trained is prefix-inpaint for it
        backends, gpu, config = None, "cpu", {"agent": "expert-planner"}
        if args.expert_turntable_rate is not None:
            config["expert_turntable_rate"] = args.expert_turntable_rate
    else:
        try:
            base, gpu, config = _backend(args.policy, args)
            backends = {"base": base}
            if args.trained_policy and args.trained_policy == args.policy:  # one engine (the turntable grid)
                backends["trained"], config["trained"] = base, dict(config)
            elif args.trained_policy:
                backends["trained"], _, config["trained"] = _backend(args.trained_policy, args)
        except Exception as e:  # noqa: BLE001  a checkpoint that does not load is a usage error, not a traceback
            return _error(f"cannot load the policy: {type(e).__name__}: {e}")
        if "prefix-guided" in strategies and config.get("engine", "eager") != "eager":
            return _error("prefix-guided (RTC guidance, a backward pass a step) runs on the eager reference only: "
                          "add --engine eager")
        for b in {id(b): b for b in backends.values()}.values():
            _warm_up(b, tasks[0], args.max_batch)
    seeds = list(range(args.seed0, args.seed0 + args.episodes))
    record = None
    if args.record_dagger is not None:
        if expert:
            return _error("--record-dagger records a policy's requests: it needs --policy CKPT, not expert")
        args.record_dagger.mkdir(parents=True, exist_ok=True)
        contract = getattr(getattr(backends["base"], "policy", None), "contract", None)
        record = {"dir": str(args.record_dagger), "tier": str(getattr(contract, "tier", None) or "256")}
    done: dict[Any, dict[str, Any]] = {}
    if args.resume:  # cells an earlier call finished, for exactly these seeds, are kept and not run again
        from ..eval.grid_report import load_cells

        # By key: a d = 0 file is named after the first strategy that asked for it, which another strategy list
        # (sync first, say) names differently although the episodes are the same.
        planned = {c.key: c for c in cells}
        found = {planned[c.key]: f for c, f in load_cells(args.out).items() if c.key in planned}
        done = {c: f for c, f in found.items() if f.get("complete")
                and f.get("seeds") == {"first": seeds[0], "last": seeds[-1]} and f.get("policy") == str(
                    args.trained_policy if c.policy == "trained" else args.policy)
                and f.get("config", {}).get("expert_turntable_rate") == args.expert_turntable_rate
                and (c.runner_strategy != "prefix" or c.seam_rows is not None
                     or f.get("config", {}).get("seam_rows", 0) == args.seam_rows)
                and f.get("config", {}).get("binary_gripper", False) == args.binary_gripper}
    # One checkpoint as both policies (the turntable grid): its two d = 0 cells would replay the same episodes, so
    # the prefix-trained one is written as a copy of the base one rather than run again (on the GPU a second run
    # differs only by the batched engine's rounding, and costs a cell's time).
    base_d0 = {c.task: c for c in cells if c.delay == 0 and c.policy == "base"}
    copies = {c: base_d0[c.task] for c in cells if c.delay == 0 and c.policy == "trained" and c.task in base_d0
              and args.trained_policy == args.policy and c not in done}
    todo = [c for c in cells if c not in done and c not in copies]
    print(f"grid: {len(todo)} cells x {len(seeds)} episodes on {args.workers} workers x {args.lanes} lanes"
          + (f" ({len(done)} done before)" if done else ""), file=sys.stderr)
    command = shlex.join(["wamrt", *sys.argv[1:]])
    config = {**config, "workers": args.workers, "lanes": args.lanes, "max_batch": args.max_batch,
              "execute_steps": args.execute_steps, "seam_rows": args.seam_rows,
              "binary_gripper": args.binary_gripper, "max_steps": args.max_steps,
              "actuation_noise": args.actuation_noise, "reflexes": args.reflexes}

    def result_of(cell: Cell, results: list[Any]) -> dict[str, Any]:
        shared = [s for s in strategies if cell.delay == 0 and _strategy_policy(s) == cell.policy]
        label = args.trained_policy if cell.policy == "trained" else args.policy
        return cell_result(cell, results, seeds, config, gpu=gpu, policy_label=str(label), shared_by=shared,
                           command=command)

    def write_cell(ci: int, results: list[Any]) -> None:
        write_result(result_of(todo[ci], results), args.out / f"{todo[ci].name}.json")

    run = run_grid(todo, seeds, backends, workers=args.workers, lanes=args.lanes, max_batch=args.max_batch,
                   max_steps=args.max_steps, env_kwargs=env_kwargs(args), execute_steps=args.execute_steps,
                   seam_rows=args.seam_rows, binary_gripper=args.binary_gripper, budget_s=args.budget_s,
                   record=record, progress=print_progress,
                   on_cell=write_cell,
                   planner_kwargs={"turntable_rate": args.expert_turntable_rate} if expert else None)
    config["grid_wall_s"] = run.wall_s
    files = {**done, **{cell: result_of(cell, run.results[ci]) for ci, cell in enumerate(todo) if run.results[ci]}}
    for copy, base0 in copies.items():
        if base0 in files:
            files[copy] = {**files[base0], "policy_role": "trained", "copy_of": f"{base0.name}.json",
                           "cell": copy.name, "shared_by": [s for s in strategies if _strategy_policy(s) == "trained"]}
            write_result(files[copy], args.out / f"{copy.name}.json")
    calls = len(run.batches)
    meta = {"policy": args.policy, "trained_policy": args.trained_policy, "command": command, "git_sha": git_sha(),
            "gpu": gpu, "episodes": len(seeds), "seeds": f"{seeds[0]}-{seeds[-1]}", "wall_s": run.wall_s,
            "execute_steps": args.execute_steps, "calls": calls,
            "mean_batch": sum(run.batches) / calls if calls else 0.0,
            "batch_ms_mean": sum(run.batch_ms) / calls if calls else None,
            "policy_busy_share": run.policy_busy_share(), "stage_ms_mean": run.stage_ms_mean(),
            "batch_hist": {str(b): run.batches.count(b) for b in sorted(set(run.batches))},
            "stopped_by_budget": run.stopped_early,
            "cells": len(cells), "cells_written": len(files)}
    path, _ = write_grid(args.out, cells, files, strategies, delays, meta)
    print(path.read_text())
    print(f"wrote {len(files)} cell files, {path} and the chart in {args.out} ({run.wall_s:.0f} s)", file=sys.stderr)
    return 0


def _strategy_policy(strategy: str) -> str:
    from ..eval.grid import GRID_STRATEGIES

    return GRID_STRATEGIES[strategy][2]
