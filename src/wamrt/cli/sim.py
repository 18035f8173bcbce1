"""`wamrt rollout`, `wamrt eval gate`, `wamrt demos record`, `wamrt export lerobot`: the simulator on the CLI.

Everything heavy (mujoco, torch, pyarrow) is imported inside the command functions, so building the parser
(`wamrt --help`) stays cheap and works without the `sim` extra; a command that needs it explains what is
missing and exits with 2.

Gate SPEC syntax: `NAME[:key=value,...]`, NAME being `expert`, a built-in model (`tiny-droid`) or a
checkpoint folder; keys are the sampling overrides steps, guidance, shift, guidance_interval (`LO-HI`),
execute_steps (rows executed per chunk) and the delay mode's strategy, delay_steps, latency_ms (`P50/P99`) and
prefix_mode (cli/realtime.py). Example: `tiny-droid:steps=2,guidance=3`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..eval.replay import compare_traces, parse_traces
from ..eval.replay import describe as describe_replay
from . import realtime as realtime_cli

EXPERT = "expert"
# Sampling overrides a SPEC may set, with their parsers (guidance_interval is "LO-HI": "," separates keys).
SPEC_KEYS: dict[str, Any] = {
    "steps": int,
    "guidance": float,
    "shift": float,
    "guidance_interval": lambda v: tuple(int(x) for x in v.split("-", 1)),
    "execute_steps": int,
    **realtime_cli.REALTIME_SPEC_KEYS,
}


class UsageError(Exception):
    """A bad argument found after parsing (task name, SPEC, checkpoint): printed, exit code 2."""


# ---- parser --------------------------------------------------------------------------------------------
def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register rollout, eval gate, demos record and export lerobot on the `wamrt` subparsers."""
    rollout = sub.add_parser("rollout", help="closed-loop success rate of a policy (or the expert) in sim")
    _add_run_arguments(rollout)
    rollout.add_argument("--policy", default=EXPERT,
                         help="'expert' (default), a built-in model (tiny-droid), a checkpoint folder, or the "
                              "ws:// URL of a `wamrt serve` (lanes are then concurrent websocket clients)")
    rollout.add_argument("--url", help="same as --policy URL: roll out against a running server")
    rollout.add_argument("--api-key", help="for a server started with --api-key")
    _add_sampling_arguments(rollout)
    rollout.set_defaults(func=run_rollout)

    ev = sub.add_parser("eval", help="evaluation").add_subparsers(dest="eval", required=True)
    gate = ev.add_parser("gate", help="paired baseline vs candidate rollouts on the same seeds -> verdict",
                         description="SPEC: NAME[:key=value,...], e.g. tiny-droid:steps=2,guidance=3 or "
                                     "ws://127.0.0.1:8000:steps=1 for a running server "
                                     "(keys: " + ", ".join(SPEC_KEYS) + ").")
    _add_run_arguments(gate)
    gate.add_argument("--baseline", required=True, metavar="SPEC",
                      help="a SPEC, or a `wamrt rollout --out` result JSON of the same task and seeds (reused)")
    gate.add_argument("--candidate", required=True, metavar="SPEC", help="a SPEC, run on the same seeds")
    gate.add_argument("--margin", type=float, default=0.05, help="non-inferiority margin (default 0.05)")
    gate.add_argument("--alpha", type=float, default=0.05, help="McNemar significance level (default 0.05)")
    gate.add_argument("--require-pass", action="store_true", help="exit 1 unless the verdict is 'pass'")
    gate.set_defaults(func=run_gate)
    realtime_cli.add_grid_command(ev)

    demos = sub.add_parser("demos", help="demonstrations").add_subparsers(dest="demos", required=True)
    rec = demos.add_parser("record", help="record scripted-expert episodes as .npz files (+ manifest.json)")
    rec.add_argument("--task", required=True, help="lift, pick_place or pick_place_two")
    rec.add_argument("--episodes", type=int, default=10, help="episodes to run (failures are dropped unless "
                     "--keep-failures)")
    rec.add_argument("--seed0", type=int, default=0, help="episode seeds are seed0 .. seed0+episodes-1")
    rec.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the .npz episodes")
    rec.add_argument("--keep-failures", action="store_true", help="also write episodes the expert failed")
    rec.add_argument("--exterior-hw", type=int, nargs=2, metavar=("H", "W"),
                     help="exterior camera size (default 128 224; the wrist camera is twice that)")
    rec.set_defaults(func=run_demos_record)

    export = sub.add_parser("export", help="dataset export").add_subparsers(dest="export", required=True)
    lr = export.add_parser("lerobot", help="recorded demos -> LeRobot dataset v3.0")
    lr.add_argument("--demos", type=Path, required=True, metavar="DIR", help="written by `demos record`")
    lr.add_argument("--out", type=Path, required=True, metavar="DIR", help="dataset folder to create")
    lr.add_argument("--robot-type", default="panda", help="robot_type in meta/info.json")
    lr.add_argument("--codec", default="libx264", help="video codec of the camera streams (PyAV name)")
    lr.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    lr.set_defaults(func=run_export_lerobot)


def _add_run_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--task", required=True, help="lift, pick_place, pick_place_two or turntable")
    ap.add_argument("--episodes", type=int, default=50, help="episodes, one per seed")
    ap.add_argument("--lanes", type=int, default=1, help="simulators run in parallel (default 1)")
    ap.add_argument("--seed0", type=int, default=0, help="episode seeds are seed0 .. seed0+episodes-1")
    ap.add_argument("--execute-steps", type=int, default=8, help="chunk rows run per inference (default 8)")
    ap.add_argument("--max-steps", type=int, help="episode step limit (default: the task's)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--out", type=Path, metavar="FILE.json", help="write the result JSON here")
    ap.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                    help="progress bar on stderr (episodes, running success rate, ETA); auto: when stderr is a "
                         "terminal")
    realtime_cli.add_delay_arguments(ap)


def _add_sampling_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, help="denoising steps (default: the policy's)")
    ap.add_argument("--guidance", type=float, help="CFG scale (default: the policy's)")
    ap.add_argument("--shift", type=float, help="flow shift of the schedule (default: the policy's)")
    ap.add_argument("--guidance-interval", type=int, nargs=2, metavar=("LO", "HI"),
                    help="apply CFG only on steps LO..HI (default: the policy's)")


# ---- helpers -------------------------------------------------------------------------------------------
def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _sim_problem() -> str | None:
    """None when wamrt.sim imports; else why not (missing extra, or no headless GL)."""
    try:
        from .. import sim  # noqa: F401  selects MUJOCO_GL before mujoco loads
    except ImportError as e:
        return f"this command needs the 'sim' extra (pip install 'wamrt[sim]'): {e}"
    except RuntimeError as e:
        return f"no headless OpenGL for the simulator (see docs/sim.md, Setup): {e}"
    return None


def _check_task(task: str) -> None:
    from ..sim.tasks import TASKS

    if task not in TASKS:
        raise UsageError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")


def _check_counts(args: argparse.Namespace) -> None:
    if args.episodes < 1 or args.lanes < 1 or args.execute_steps < 1:
        raise UsageError("--episodes, --lanes and --execute-steps must be >= 1")


@dataclass(frozen=True)
class PolicySpec:
    name: str  # "expert", built-in name or checkpoint folder
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling options for Policy.infer
    execute_steps: int | None = None  # None: the command's --execute-steps
    realtime: dict[str, Any] = field(default_factory=dict)  # delay-mode SPEC keys (cli.realtime)


def parse_spec(spec: str) -> PolicySpec:
    """`NAME[:k=v,...]` -> PolicySpec. Only a tail with '=' is read as overrides (a folder may hold ':')."""
    name, sep, tail = spec.rpartition(":")
    if not (sep and name and "=" in tail):
        return PolicySpec(spec)
    overrides: dict[str, Any] = {}
    for item in tail.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in SPEC_KEYS:
            raise UsageError(f"bad SPEC item {item!r} in {spec!r} (keys: {', '.join(SPEC_KEYS)})")
        try:
            overrides[key] = SPEC_KEYS[key](value.strip())
        except ValueError as e:
            raise UsageError(f"bad value for {key} in {spec!r}: {value!r}") from e
    execute_steps = overrides.pop("execute_steps", None)
    if execute_steps is not None and execute_steps < 1:
        raise UsageError(f"execute_steps must be >= 1 in {spec!r}")
    realtime = {k: overrides.pop(k) for k in list(overrides) if k in realtime_cli.REALTIME_SPEC_KEYS}
    if name == EXPERT and overrides:
        raise UsageError("sampling overrides do not apply to the expert")
    return PolicySpec(name, overrides, execute_steps, realtime)


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    gi = tuple(args.guidance_interval) if args.guidance_interval else None
    return {k: v for k, v in (("steps", args.steps), ("guidance", args.guidance), ("shift", args.shift),
                              ("guidance_interval", gi)) if v is not None}


class _SerialPolicy:
    """One loaded policy shared by thread lanes: inference is serialized (a second concurrent forward only
    competes for the same GPU or CPU cores), while the other lanes keep stepping their simulators."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.lock = policy, threading.Lock()

    def infer(self, obs: dict[str, Any], **kwargs: Any) -> Any:
        with self.lock:
            return self.policy.infer(obs, **kwargs)


@dataclass
class Side:
    """What one rollout set runs: the agent factory, the run backend and the labels for the result JSON."""

    label: str
    factory: Callable[[], Any]  # -> an eval.agents Agent, built once per lane
    backend: str
    config: dict[str, Any]
    gpu: str = "cpu"
    outcomes: list[bool] | None = None  # already known (a recorded rollout): nothing to run
    traces: list[list[str]] | None = None  # its per-seed request digests, if it recorded them
    settings: Any = None  # eval.realtime.RealtimeSettings of a delay-mode side
    recorded_delay: dict[str, Any] = field(default_factory=dict)  # a recorded side's delay-mode fields

    def delay_fields(self) -> dict[str, Any]:
        return self.recorded_delay or realtime_cli.result_fields(self.settings)


def recorded_side(path: str, task: str, seeds: list[int]) -> Side:
    """A `kind: rollout` result file as one side of a gate: its per-seed outcomes, checked to be the same
    task and exactly the gate's seeds, so one baseline run can be paired with several candidates."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read rollout result {path}: {e}") from e
    if res.get("kind") != "rollout" or "outcomes" not in res:
        raise UsageError(f"{path} is not a rollout result with per-seed outcomes")
    got = res.get("seeds")
    got = list(range(got["first"], got["last"] + 1)) if isinstance(got, dict) else list(got or [])
    if res.get("task") != task or got != seeds:
        raise UsageError(f"{path} holds task {res.get('task')!r} seeds {got[:1]}..{got[-1:]}; the gate needs "
                         f"{task!r} seeds {seeds[0]}..{seeds[-1]}")
    traces = parse_traces(res["traces"]) if "traces" in res else None
    delay = {k: res[k] for k in ("strategy", "clock", "delay_steps", "latency_ms", "prefix_mode") if k in res}
    return Side(path, lambda: None, "recorded", {**res.get("config", {}), "recorded": path},
                res.get("gpu", "cpu"), [bool(x) for x in res["outcomes"]], traces, recorded_delay=delay)


def _load_side(spec: PolicySpec, label: str, args: argparse.Namespace, cache: dict[str, Any]) -> Side:
    """Expert: process lanes (picklable factory, no weights). Policy: loaded once in this process and shared
    by thread lanes (per-process copies would multiply load time and GPU memory). With a delay-mode flag or SPEC
    key, every kind runs on the robot's clock (eval.realtime; the expert becomes the chunk planner)."""
    from dataclasses import asdict, replace

    from ..eval.agents import ExpertAgent, PolicyAgent
    from ..eval.realtime import RealtimeAgent, RealtimeAgentFactory
    from ..eval.remote import RemoteAgentFactory, effective_sampling, is_url, server_metadata

    execute = spec.execute_steps or args.execute_steps
    common = {"lanes": args.lanes, "max_steps": args.max_steps}
    common.update(realtime_cli.env_kwargs(args))
    try:
        rt = realtime_cli.delay_settings(args, spec.realtime)
    except realtime_cli.RealtimeUsageError as e:
        raise UsageError(f"{label}: {e}") from e
    if rt is not None:
        rt = replace(rt, execute_steps=execute)
        if rt.wall_clock and not is_url(spec.name):
            raise UsageError("--wall-clock runs against a server: give --url ws://...")
        common["realtime"] = rt.describe()
    if spec.name == EXPERT:
        if rt is not None:  # the expert as a chunk planner on privileged state (eval.planner)
            return Side(label, RealtimeAgentFactory(args.task, EXPERT, rt), "process",
                        {"agent": "expert-planner", **common}, settings=rt)
        return Side(label, ExpertAgent, "process", {"agent": EXPERT, **common})
    if is_url(spec.name):
        # Process lanes, each its own websocket client: the server batches them like separate robots.
        api_key = getattr(args, "api_key", None)
        factory = (RemoteAgentFactory(spec.name, execute, dict(spec.overrides), api_key) if rt is None else
                   RealtimeAgentFactory(args.task, spec.name, rt, dict(spec.overrides), api_key))
        try:
            server = server_metadata(spec.name, api_key)
        except (OSError, ValueError) as e:  # the rollout itself will say whether the server is there
            server = {"error": f"no metadata from the server: {e}"}
        return Side(label, factory, "process", {"agent": "remote", "url": spec.name, "execute_steps": execute,
                                                **spec.overrides, "server": server,
                                                "effective": effective_sampling(server, dict(spec.overrides)),
                                                **common}, gpu=str(server.get("gpu", "unknown")), settings=rt)
    if spec.name not in cache:
        cache[spec.name] = _load_policy(spec.name, args)
    policy = cache[spec.name]
    try:
        opts = replace(policy.options, **spec.overrides)
    except TypeError as e:
        raise UsageError(f"bad sampling override for {label}: {e}") from e
    sampling = {k: asdict(opts)[k] for k in ("steps", "guidance", "shift", "guidance_interval")}
    shared = _SerialPolicy(policy)
    dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    config = {"agent": "policy", "model": spec.name, "execute_steps": execute, **sampling,
              "device": str(policy.device), "dtype": dtype, **common}
    if rt is not None:
        return Side(label, lambda: RealtimeAgent(shared, rt, **spec.overrides), "thread", config,
                    _gpu_name(policy.device), settings=rt)
    return Side(label, lambda: PolicyAgent(shared, execute_steps=execute, **spec.overrides), "thread", config,
                _gpu_name(policy.device))


def _load_policy(name: str, args: argparse.Namespace) -> Any:
    import torch

    from .. import load_policy
    from ..pipeline.errors import RequestError

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype or "")
    try:
        return load_policy(name, device=args.device, dtype=dtype)
    except (RequestError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e


def _gpu_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _run_side(side: Side, args: argparse.Namespace, seeds: list[int]) -> list[Any]:
    from ..eval.runner import RolloutProgress, run_rollouts

    shown = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    bar = RolloutProgress(len(seeds), side.label, enabled=shown)
    try:
        results = run_rollouts(args.task, side.factory, seeds, lanes=args.lanes, backend=side.backend,
                               env_kwargs=realtime_cli.env_kwargs(args), max_steps=args.max_steps, on_result=bar)
    finally:
        bar.close()
    errors = [r for r in results if r.error]
    if errors:  # counted as failures by the runner; say so, or a crash would read as a bad policy
        print(f"warning: {side.label}: {len(errors)} episode(s) raised; first (seed {errors[0].seed}):\n"
              f"{errors[0].error}", file=sys.stderr)
    return results


def _rate_line(label: str, k: int, n: int) -> str:
    from ..eval.stats import wilson_ci

    lo, hi = wilson_ci(k, n)
    return f"{label}: {k}/{n} = {k / n:.1%} (Wilson 95% CI {lo:.1%} .. {hi:.1%})"


# ---- commands ------------------------------------------------------------------------------------------
def run_rollout(args: argparse.Namespace) -> int:
    if problem := _sim_problem():
        return _error(problem)
    from ..eval.results import rollout_result, write_result

    try:
        _check_task(args.task)
        _check_counts(args)
        if args.url:
            if args.policy != EXPERT and args.policy != args.url:
                raise UsageError("give either --url or --policy, not both")
            args.policy = args.url
        overrides = _cli_overrides(args)
        if args.policy == EXPERT and overrides:
            raise UsageError("sampling options (--steps, --guidance, ...) do not apply to the expert")
        side = _load_side(PolicySpec(args.policy, overrides), args.policy, args, {})
    except UsageError as e:
        return _error(str(e))
    seeds = list(range(args.seed0, args.seed0 + args.episodes))
    results = _run_side(side, args, seeds)
    print(_rate_line(f"{args.task} / {args.policy}", sum(r.success for r in results), len(results)))
    stages = Counter(r.stage for r in results)
    print("stages: " + ", ".join(f"{k} {v}" for k, v in sorted(stages.items())))
    if side.settings is not None:
        print(realtime_cli.summary_line(results))
    if args.out:
        res = rollout_result(args.task, args.policy, results, side.config, gpu=side.gpu)
        res.update(realtime_cli.result_fields(side.settings))
        print(f"wrote {write_result(res, args.out)}")
    return 0


def run_gate(args: argparse.Namespace) -> int:
    if problem := _sim_problem():
        return _error(problem)
    from ..eval.results import gate_result, write_result
    from ..eval.stats import gate

    try:
        _check_task(args.task)
        _check_counts(args)
        seeds = list(range(args.seed0, args.seed0 + args.episodes))
        cache: dict[str, Any] = {}  # one load per model: specs differing only in sampling share weights
        sides = [recorded_side(s, args.task, seeds) if s.endswith(".json")
                 else _load_side(parse_spec(s), s, args, cache) for s in (args.baseline, args.candidate)]
    except UsageError as e:
        return _error(str(e))
    for side in sides:
        if side.outcomes is None:
            results = _run_side(side, args, seeds)
            side.outcomes = [r.success for r in results]
            side.traces = [r.trace for r in results] if any(r.trace for r in results) else None
    base_ok, cand_ok = sides[0].outcomes, sides[1].outcomes
    d = gate(base_ok, cand_ok, alpha=args.alpha, margin=args.margin)
    replay = compare_traces(sides[0].traces, sides[1].traces) if sides[0].traces and sides[1].traces else None
    print(_rate_line(f"baseline  {args.baseline}", sum(base_ok), len(seeds)))
    print(_rate_line(f"candidate {args.candidate}", sum(cand_ok), len(seeds)))
    lo, hi = d.diff_ci95
    print(f"discordant: baseline only {d.table.baseline_only}, candidate only {d.table.candidate_only}; "
          f"exact McNemar p = {d.p_value:.4g}")
    print(f"difference {d.diff:+.1%} (95% CI {lo:+.1%} .. {hi:+.1%}, margin {args.margin:.1%})")
    print(f"verdict: {d.verdict}")
    if replay is not None:
        print(describe_replay(replay))
    if args.out:
        config = {"baseline": sides[0].config, "candidate": sides[1].config, "alpha": args.alpha,
                  "margin": args.margin}
        delays = {name: side.delay_fields() for name, side in zip(("baseline", "candidate"), sides, strict=True)}
        gpu = next((s.gpu for s in sides if s.gpu != "cpu"), "cpu")
        res = gate_result(args.task, args.baseline, args.candidate, seeds, base_ok, cand_ok, d, config,
                          gpu=gpu, replay=replay)
        if any(delays.values()):  # delay mode: each side's own d (the bars read delay_steps)
            res["delay_steps"] = {k: v.get("delay_steps") for k, v in delays.items()}
            res["realtime"] = delays
        print(f"wrote {write_result(res, args.out)}")
    return 1 if args.require_pass and d.verdict != "pass" else 0


def run_demos_record(args: argparse.Namespace) -> int:
    if problem := _sim_problem():
        return _error(problem)
    from ..sim.record import record_demos

    try:
        _check_task(args.task)
        if args.episodes < 1:
            raise UsageError("--episodes must be >= 1")
    except UsageError as e:
        return _error(str(e))
    env_kwargs = {"exterior_hw": tuple(args.exterior_hw)} if args.exterior_hw else None
    seeds = range(args.seed0, args.seed0 + args.episodes)
    metas = record_demos(args.task, seeds, args.out, success_only=not args.keep_failures,
                         env_kwargs=env_kwargs)
    ok = sum(m.success for m in metas)
    print(f"{args.task}: wrote {len(metas)} episode(s) of {args.episodes} ({ok} successful) to {args.out}")
    return 0 if metas else 1  # nothing written is a failure a script should notice


def run_export_lerobot(args: argparse.Namespace) -> int:
    if problem := _sim_problem():  # the exporter reads episodes through wamrt.sim.record
        return _error(problem)
    try:
        from ..eval.lerobot_export import export_lerobot  # pyarrow + pandas
    except ImportError as e:
        return _error(f"this command needs the 'sim' extra (pip install 'wamrt[sim]'): {e}")
    files = sorted(Path(args.demos).glob("episode_*.npz"))
    if not files:
        return _error(f"no episode_*.npz files in {args.demos} (write them with `wamrt demos record`)")
    if args.force and (args.out / "meta" / "info.json").is_file():
        shutil.rmtree(args.out)  # only a folder that holds a LeRobot dataset is replaced
    try:
        root = export_lerobot(files, args.out, robot_type=args.robot_type, codec=args.codec)
    except FileExistsError as e:
        return _error(f"{e} (pass --force to replace it)")
    except ImportError as e:  # PyAV is imported only when the first video is encoded
        return _error(f"the LeRobot export needs PyAV (pip install 'wamrt[sim]'): {e}")
    print(f"wrote a LeRobot v3.0 dataset of {len(files)} episode(s) to {root}")
    return 0
