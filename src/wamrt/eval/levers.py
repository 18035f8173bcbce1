"""The lossy serving levers on the robot's clock: every Cosmos 3 configuration's measured H200 latency, the control
steps a request spans at 15 Hz (d = ceil(latency / 66.7 ms)), and the server-side config that reproduces the lever
on a trained policy for a paired gate at that d (docs/prefix.md, "The levers on the robot's clock").

A lever is judged by `wamrt eval gate` between the bf16 4-step configuration at its own d (the baseline, one rollout
per size) and the lever at its own d, with the same strategy on both sides: a faster, slightly worse configuration
can win once the robot's time is counted. The latencies are read from committed result files, never typed in.

`python -m wamrt.eval.levers` prints one tab-separated line per configuration (size, name, d, p50 ms, gate SPEC
suffix, quantization recipe, result file), what scripts/lever_gates.sh runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTROL_HZ = 15.0
STEP_MS = 1e3 / CONTROL_HZ  # 66.7 ms
RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results" / "latency"
# CFG on the first step only: the interval is strict (lo < t < hi), so (t1, t0 + 1) keeps the first timestep alone.
FIRST_STEP_ONLY = {4: (937, 1000), 2: (833, 1000)}  # the framework schedule's [999, 937, 833, 624] / [999, 833]


@dataclass(frozen=True)
class Lever:
    size: str  # "edge" | "nano"
    name: str  # "bf16" (the baseline), "steps2", "interval", "gen-fp8", "gen-fp8-steps2", "gen-fp8-steps2-interval"
    result: str  # the latency result file under bench/results/latency whose p50 this configuration runs at
    steps: int = 4
    interval: bool = False  # guidance on the first step only
    recipe: str | None = None  # a `wamrt quantize` recipe the gate's server is started with
    note: str = field(default="", compare=False)

    def latency_ms(self, root: Path = RESULTS) -> float:
        return float(json.loads((root / self.result).read_text())["p50_ms"])

    def delay_steps(self, root: Path = RESULTS) -> int:
        return delay_steps(self.latency_ms(root))

    def overrides(self) -> dict[str, Any]:
        """Sampling overrides of the gate's SPEC (the server's defaults: 4 steps, guidance 3, CFG every step)."""
        out: dict[str, Any] = {}
        if self.steps != 4:
            out["steps"] = self.steps
        if self.interval:
            out["guidance_interval"] = FIRST_STEP_ONLY[self.steps]
        return out

    def spec_suffix(self) -> str:
        """`:k=v,...` for `wamrt eval gate` SPECs ("" when none)."""
        items = [f"{k}={'-'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in self.overrides().items()]
        return ":" + ",".join(items) if items else ""


def delay_steps(latency_ms: float, hz: float = CONTROL_HZ) -> int:
    """Control steps a request spans: the robot executes committed rows for ceil(latency / period) steps."""
    return max(1, math.ceil(latency_ms * hz / 1e3 - 1e-9))


# The latest committed p50 of each configuration with today's kernels (flash-attn-4 + quack, gen-fp8 with fast
# accumulation where measured). One process per model, back to back, batch 1, before any network time.
LEVERS: tuple[Lever, ...] = (
    Lever("edge", "bf16", "2026-12-04-0bb487e-interval-fa4/edge/edge-s4-E5-quack.json"),
    Lever("edge", "steps2", "2026-12-04-2237846-peer/edge/edge-s2-E5-quack.json", steps=2),
    Lever("edge", "interval", "2026-12-04-0bb487e-interval-fa4/edge/edge-s4-E5-quack-interval.json", interval=True),
    Lever("edge", "gen-fp8", "2026-12-03-1ba1cea-fast-accum/run2-edge-s4-E6-fast-accum.json", recipe="gen-fp8"),
    Lever("edge", "gen-fp8-steps2", "2026-12-04-7a525e4-read-rows/edge/edge-s2-E7.json", steps=2, recipe="gen-fp8"),
    Lever("edge", "gen-fp8-steps2-interval", "2026-12-03-0d25082-defaults/edge-s2-E8.json", steps=2, interval=True,
          recipe="gen-fp8", note="measured before fast accumulation (E7 then 63.3 ms, now 51.1): an upper bound"),
    Lever("nano", "bf16", "2026-12-04-0bb487e-interval-fa4/nano/nano-s4-E5-quack.json"),
    Lever("nano", "steps2", "2026-12-04-2237846-peer/nano/nano-s2-E5-quack.json", steps=2),
    Lever("nano", "interval", "2026-12-04-0bb487e-interval-fa4/nano/nano-s4-E5-quack-interval.json", interval=True),
    Lever("nano", "gen-fp8", "2026-12-03-42870eb-heads/nano-s4-E6-heads-gqa.json", recipe="gen-fp8",
          note="measured before fast accumulation (E7 -6 % since): 400 ms or less would make d 6"),
    Lever("nano", "gen-fp8-steps2", "2026-12-04-7a525e4-read-rows/nano/nano-s2-E7.json", steps=2, recipe="gen-fp8"),
    Lever("nano", "gen-fp8-steps2-interval", "2026-12-02-dd746d7-fp8/nano-s2-E8.json", steps=2, interval=True,
          recipe="gen-fp8", note="measured before fast accumulation and the stacked K/V: an upper bound"),
)


def table(root: Path = RESULTS) -> list[dict[str, Any]]:
    return [{"size": lv.size, "name": lv.name, "delay_steps": lv.delay_steps(root),
             "latency_ms": round(lv.latency_ms(root), 1), "spec": lv.spec_suffix(), "recipe": lv.recipe,
             "result": lv.result, "note": lv.note} for lv in LEVERS]


def main() -> None:
    for row in table():
        print("\t".join(str(row[k]) if row[k] not in (None, "") else "-" for k in
                        ("size", "name", "delay_steps", "latency_ms", "spec", "recipe", "result")))


if __name__ == "__main__":
    main()
