"""The delay mode on the command line: flags of `wamrt rollout` / `wamrt eval gate`, and `wamrt eval grid`.

`--delay-steps N` or `--latency-ms P50[,P99]|FILE` (or `--strategy` alone, d = 0) runs episodes on the robot's
clock (`wamrt.eval.realtime`): a request answered d control steps after its observation, the arm executing the
committed rows meanwhile. `--wall-clock` (with a server URL) runs the same runner at 15 Hz in real time instead.
A gate SPEC may set its own `strategy=`, `delay_steps=`, `latency_ms=P50/P99` and `prefix_mode=`, so each side of
a gate runs at its own latency.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..client.realtime import PREFIX_MODES, STRATEGIES

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
    g.add_argument("--wall-clock", action="store_true",
                   help="real time: each lane runs the 15 Hz client against the --url server (real latency)")
    g.add_argument("--actuation-noise", type=float, default=0.0, metavar="RAD",
                   help="seeded OU noise (std, rad) on every executed joint target (default 0)")


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
    if strategy is None and steps is None and latency is None and not wall:
        return None
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
    return RealtimeSettings(strategy or "async", model, mode, args.execute_steps, wall)


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
            f"stood still {s['stall_fraction']:.1%} of steps, steps to success {f(s['steps_to_success_mean'], '.1f')}, "
            f"jerk at chunk boundaries {f(s['jerk_boundary_mean'], '.0f')} vs inside {f(s['jerk_inside_mean'], '.0f')} "
            f"rad/s^3")
