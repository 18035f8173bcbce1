"""One table and one chart of `panda-droid-rt` on the turntable: every strategy against d, 200 paired seeds a cell.

Reads this folder's H100 cells (d = 3, 6, 10; d = 6 from d6/, which replaces d3-6/'s incomplete d = 6 cells) and round 9's gate cells (d = 0, and prefix-trained at d = 10: the same
checkpoint, the same H100 engine, the same seeds 0-199), pairs each cell with naive async at its d and with d = 0
(exact McNemar), prints the table (the README's) and writes success-vs-delay.png here.

    PYTHONPATH=src python bench/results/rollout/2026-12-07-51075c8-rt-strategies-h100/combine.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from wamrt.eval.grid_report import chart, paired
from wamrt.eval.stats import wilson_ci

HERE = Path(__file__).resolve().parent
ROUND9 = HERE.parent / "2026-12-07-ea07e0d-dagger-rounds8-9-new-expert-h100/round9/grid-call/grid/turntable"
STRATEGIES = ["sync", "async", "blend", "prefix-trained", "prefix-trained-seam"]
LABELS = {"prefix-trained-seam": "prefix-trained, 10-row seam"}


def cells() -> dict[tuple[int, str], tuple[Path, dict]]:
    found: dict[tuple[int, str], tuple[Path, dict]] = {}
    for path in [ROUND9 / "turntable-d0-trained.json", ROUND9 / "turntable-d10-prefix-trained.json",
                 *sorted((HERE / "d10/grid/turntable").glob("turntable-d*.json")),
                 *sorted((HERE / "d3-6/grid/turntable").glob("turntable-d*.json")),
                 # d = 6 again, every strategy complete (a later call): these replace d3-6/'s d = 6 cells
                 *sorted((HERE / "d6/grid/turntable").glob("turntable-d*.json"))]:
        res = json.loads(path.read_text())
        found[(int(res["delay_steps"]), "any" if res["delay_steps"] == 0 else res["strategy"])] = (path, res)
    return found


def main() -> None:
    found = cells()
    d0_path, d0 = found[(0, "any")]
    lines = ["| d | strategy | success (Wilson 95 %) | vs naive async, same d | vs d = 0 | stood still | "
             "jerk boundary / inside (rad/s³) |", "|---|---|---|---|---|---|---|"]
    rows = []
    for (d, s), (path, res) in sorted(found.items(), key=lambda kv: (kv[0][0], STRATEGIES.index(kv[0][1])
                                                                     if kv[0][1] in STRATEGIES else -1)):
        k, n = res["successes"], res["episodes"]
        lo, hi = wilson_ci(k, n)
        rt = res.get("realtime", {})

        def vs(ref: dict | None, res: dict = res) -> str:
            if ref is None or ref is res:
                return ""
            p = paired(ref, res)
            return f"{100 * p['diff']:+.1f} (p = {p['p']:.2g})"

        asy = found.get((d, "async"), (None, None))[1]
        link = os.path.relpath(path, HERE)
        lines.append(f"| {d} | {LABELS.get(s, s)} | [{k}/{n} = {100 * k / n:.1f} %]({link}) ({100 * lo:.1f}–"
                     f"{100 * hi:.1f}){'' if res.get('complete', True) else ' **incomplete**'} | "
                     f"{vs(asy) if d else ''} | {vs(d0) if d else ''} | "
                     f"{100 * rt.get('stall_fraction', 0):.1f} % | {rt.get('jerk_boundary_mean', 0):.0f} / "
                     f"{rt.get('jerk_inside_mean', 0):.0f} |")
        for strategy in (STRATEGIES if d == 0 else [s]):  # d = 0 is every strategy's starting point
            rows.append({"task": "turntable", "d": d, "strategy": strategy, "policy": "trained", "rate": k / n,
                         "ci95": [lo, hi]})
    for d, a, b in [(3, "prefix-trained", "blend"), (6, "prefix-trained", "blend"), (10, "prefix-trained", "blend"),
                    (10, "prefix-trained", "prefix-trained-seam")]:
        p = paired(found[(d, a)][1], found[(d, b)][1])
        lines.append(f"\n{b} against {a} at d = {d}: {100 * p['diff']:+.1f} points, {p['a_only']} / {p['b_only']} "
                     f"discordant, p = {p['p']:.2g}")
    # the seam was run at d = 10 only: a line from d = 0 straight to it would draw cells that were never run
    chart([r for r in rows if r["strategy"] != "prefix-trained-seam"], STRATEGIES[:-1], HERE / "success-vs-delay.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
