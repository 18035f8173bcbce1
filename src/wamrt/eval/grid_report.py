"""What `wamrt eval grid` writes: one `kind: rollout` file per cell, a markdown table and a chart of success
against d per strategy.

Each delayed cell is paired (same seeds, exact McNemar on the discordant pairs) with naive async at its d and
with its own d = 0 cell (the base policy's lock-step cell, or the prefix-trained checkpoint's for
`prefix-trained`); only seeds both cells finished are paired.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .grid import GRID_STRATEGIES, Cell, cell_for
from .results import rollout_result, write_result
from .stats import PairedTable, mcnemar_exact, wilson_ci


def cell_result(cell: Cell, results: Sequence[Any], seeds: Sequence[int], config: dict[str, Any], *, gpu: str,
                policy_label: str, shared_by: Sequence[str], command: str | None = None) -> dict[str, Any]:
    res = rollout_result(cell.task, policy_label, results, config, gpu=gpu, command=command)
    res.update(strategy="any (d = 0: every strategy is the lock-step rollout)" if cell.delay == 0 else cell.strategy,
               delay_steps=cell.delay, clock="simulated", cell=cell.name, complete=len(results) == len(seeds),
               policy_role=cell.policy)
    if cell.delay == 0:
        res["shared_by"] = list(shared_by)
    elif cell.runner_strategy == "prefix":
        res["prefix_mode"] = cell.prefix_mode
    return res


def _outcomes(res: dict[str, Any]) -> dict[int, bool]:
    seeds = res["seeds"]
    seeds = list(range(seeds["first"], seeds["last"] + 1)) if isinstance(seeds, dict) else list(seeds)
    return {s: bool(o) for s, o in zip(seeds, res["outcomes"], strict=True)}


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """b against a on their common seeds: difference of success rates and the exact McNemar p."""
    oa, ob = _outcomes(a), _outcomes(b)
    common = sorted(set(oa) & set(ob))
    t = PairedTable.from_outcomes([oa[s] for s in common], [ob[s] for s in common])
    return {"episodes": len(common), "diff": (t.candidate_only - t.baseline_only) / len(common) if common else 0.0,
            "p": mcnemar_exact(t.baseline_only, t.candidate_only), "a_only": t.baseline_only,
            "b_only": t.candidate_only}


def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def summary(cells: Sequence[Cell], files: dict[Cell, dict[str, Any]], strategies: Sequence[str],
            delays: Sequence[int]) -> tuple[str, list[dict[str, Any]]]:
    """Markdown tables (one per task) and the same rows as dicts."""
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    for task in dict.fromkeys(c.task for c in cells):
        lines += [f"### {task}", "",
                  "| d | strategy | success (Wilson 95 %) | vs async at this d | vs its own d = 0 | stood still | "
                  "steps to success (median: reach / lift / place) | jerk boundary / inside (rad/s³) |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in sorted(set(delays)):
            for s in strategies:
                cell = cell_for(cells, task, d, s)
                if cell is None or cell not in files:
                    continue
                if d == 0 and cell.strategy != s:
                    continue  # a shared d = 0 cell is listed once, under the first strategy that uses it
                res = files[cell]
                k, n = res["successes"], res["episodes"]
                lo, hi = wilson_ci(k, n) if n else (0.0, 1.0)
                rt = res.get("realtime", {})
                row: dict[str, Any] = {"task": task, "d": d, "strategy": "any" if d == 0 else s,
                                       "policy": cell.policy, "successes": k, "episodes": n, "rate": k / n if n else 0,
                                       "ci95": [lo, hi], "file": f"{cell.name}.json",
                                       "stall_fraction": rt.get("stall_fraction"),
                                       "steps_to_success": rt.get("steps_to_success_mean"),
                                       "jerk_boundary": rt.get("jerk_boundary_mean"),
                                       "jerk_inside": rt.get("jerk_inside_mean"),
                                       "phase_steps": res.get("summary", {}).get("phase_steps_median")}
                ref_async = cell_for(cells, task, d, "async")
                own0 = cell_for(cells, task, 0, s)
                for name, ref in (("vs_async", ref_async), ("vs_own_d0", own0)):
                    if d > 0 and ref is not None and ref in files and ref != cell:
                        row[name] = paired(files[ref], res)
                label = ("d = 0 (" + ("prefix-trained checkpoint" if cell.policy == "trained" else "base policy")
                         + ")") if d == 0 else s

                def vs(name: str) -> str:
                    p = row.get(name)
                    return "" if p is None else f"{p['diff']:+.1%} (p = {p['p']:.2g})"

                lines.append(
                    f"| {d} | {label} | [{k}/{n} = {k / n if n else 0:.1%}]({cell.name}.json) ({lo:.1%}–{hi:.1%})"
                    f"{'' if res.get('complete', True) else ' **incomplete**'} | {vs('vs_async')} | "
                    f"{vs('vs_own_d0')} | {_fmt(row['stall_fraction'], '.1%')} | "
                    f"{_fmt(row['steps_to_success'], '.0f')}{_phases(row['phase_steps'])} | "
                    f"{_fmt(row['jerk_boundary'], '.0f')} / "
                    f"{_fmt(row['jerk_inside'], '.0f')} |")
                rows.append(row)
        lines.append("")
    return "\n".join(lines), rows


def _phases(spans: dict[str, float | None] | None) -> str:
    """' (41 / 20 / 95)': the median steps to reach the cube, from reach to lift, from lift to success."""
    if not spans or all(v is None for v in spans.values()):
        return ""  # a cell written before milestones were recorded
    parts = [_fmt(spans.get(k), ".0f") for k in ("reach", "reach_to_lift", "lift_to_success")]
    return f" ({' / '.join(parts)})"


def chart(rows: Sequence[dict[str, Any]], strategies: Sequence[str], path: Path) -> Path | None:
    """Success against d, one line per strategy (each starting at its own d = 0), one panel per task; None when
    matplotlib (the bench extra) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for s in strategies:
            policy = GRID_STRATEGIES[s][2]
            pts = sorted((r["d"], r["rate"], r["ci95"]) for r in rows if r["task"] == task and (
                r["strategy"] == s or (r["d"] == 0 and r["policy"] == policy)))
            if not pts:
                continue
            d = [p[0] for p in pts]
            rate = [p[1] for p in pts]
            err = [[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]]
            ax.errorbar(d, rate, yerr=err, marker="o", capsize=3, label=s)
        ax.set_title(task)
        ax.set_xlabel("delay d (control steps at 15 Hz)")
        ax.set_ylabel("success rate (Wilson 95 %)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_cells(out: Path) -> dict[Cell, dict[str, Any]]:
    """The cell files a grid run wrote into `out` (also those of a run killed before its summary)."""
    files: dict[Cell, dict[str, Any]] = {}
    for path in sorted(out.glob("*.json")):
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(res, dict) or res.get("kind") != "rollout" or "cell" not in res:
            continue
        d = int(res["delay_steps"])
        if d == 0:  # the policy's role decides (copies written before f1ce3c5 kept the base cell's shared_by)
            trained = res.get("policy_role") == "trained"
            shared = [s for s in res.get("shared_by") or []
                      if s in GRID_STRATEGIES and (GRID_STRATEGIES[s][2] == "trained") == trained]
            strategy = shared[0] if shared else ("prefix-trained" if trained else "async")
        else:
            strategy = res["strategy"]
        if strategy in GRID_STRATEGIES:
            files[Cell(res["task"], d, strategy)] = res
    return files


def _call_time(meta: dict[str, Any]) -> str:
    """', X ms a call (stage a ms, ...), the policy busy Y % of the wall' where the run measured it."""
    if meta.get("batch_ms_mean") is None:
        return ""
    text = f", {meta['batch_ms_mean']:.0f} ms a call"
    if stages := meta.get("stage_ms_mean"):
        text += " (" + ", ".join(f"{k} {v:.1f} ms" for k, v in stages.items()) + ")"
    if "policy_busy_share" in meta:
        text += f", the policy busy {100 * meta['policy_busy_share']:.0f} % of the wall"
    return text


def write_grid(out: Path, cells: Sequence[Cell], files: dict[Cell, dict[str, Any]], strategies: Sequence[str],
               delays: Sequence[int], meta: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    out.mkdir(parents=True, exist_ok=True)
    for cell, res in files.items():
        write_result(res, out / f"{cell.name}.json")
    table, rows = summary(cells, files, strategies, delays)
    png = chart(rows, strategies, out / "success-vs-delay.png")
    head = [f"# Strategy x delay grid: {meta.get('policy')}", "", f"`{meta.get('command')}`", ""]
    if "wall_s" in meta:
        head += [f"git {meta.get('git_sha')}, {meta.get('gpu')}, {meta.get('episodes')} episodes per cell (seeds "
                 f"{meta.get('seeds')}), {meta['wall_s']:.0f} s; request period {meta.get('execute_steps')} rows; "
                 f"policy calls: {meta.get('calls')} batches, mean batch {meta.get('mean_batch', 0):.1f}"
                 f"{_call_time(meta)}.", ""]
    if png is not None:
        head += [f"![success against d]({png.name})", ""]
    (out / "summary.md").write_text("\n".join(head) + table + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return out / "summary.md", rows
