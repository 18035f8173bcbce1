"""`wamrt bench waterfall`: one chart from committed `kind: latency` result files.

`wamrt bench latency` draws the rows of its own run with `plot` too. The README's chart spans several runs (the
E0..E5 waterfall of one commit, the kernels of later ones), so each bar is labelled with its row, steps and the commit
it ran at, lossy rows are coloured apart, and the peer, floors and target come from the files themselves.
Nothing is measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EXACT_COLOR, LOSSY_COLOR, PEER_COLOR = "#4c72b0", "#dd8452", "#c44e52"


def load_rows(paths: list[Path], notes: list[str] | None = None) -> list[dict]:
    """The result records, checked to be latency rows of one model (a chart mixing models would mislead). `notes`:
    one per file ("" for none), a last label line for what the file does not say (e.g. an environment variable the
    run had)."""
    rows = []
    for i, p in enumerate(paths):
        record = json.loads(p.read_text())
        if record.get("kind") != "latency" or "p50_ms" not in record:
            raise SystemExit(f"{p}: not a `kind: latency` result file")
        if notes and notes[i]:
            record = {**record, "chart_note": notes[i]}
        rows.append(record)
    models = {r["model"] for r in rows}
    if len(models) > 1:
        raise SystemExit(f"rows of several models {sorted(models)}: one chart per model")
    return rows


def _wrap(row: str, width: int = 11) -> str:
    """A row name broken after its dashes into lines of about `width` characters (tick labels sit side by side)."""
    lines = [""]
    for part in row.split("-"):
        piece = part if not lines[-1] else "-" + part
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines[-1] += "-"
            lines.append(part)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def bars(rows: list[dict], peer_from: int | None = None) -> list[dict]:
    """Bar specs (label, ms, CI low/high, colour): each row, then the peer of row `peer_from` (default: the first row
    that has one)."""
    out = []
    for r in rows:
        lo, hi = r["ci95_p50_ms"]
        pace = f" @{r['pace_hz']:g} Hz" if r.get("pace_hz") else ""  # a robot's clock, not back to back
        label = f"{_wrap(r['row'])}\n{r['steps']} st{pace}\n{r.get('git_sha') or '?'}"
        if r.get("chart_note"):
            label += "\n" + r["chart_note"]
        out.append({"label": label, "ms": r["p50_ms"], "err": (r["p50_ms"] - lo, hi - r["p50_ms"]),
                    "color": LOSSY_COLOR if r.get("lossy") else EXACT_COLOR})
    with_peer = [r for r in rows if r.get("peer")]
    if peer_from is not None:
        with_peer = [rows[peer_from]] if rows[peer_from].get("peer") else []
    if with_peer:
        p = with_peer[0]["peer"]
        lo, hi = p["ci95_p50_ms"]
        out.append({"label": f"diffusers\n{with_peer[0]['steps']} st\n{with_peer[0].get('git_sha') or '?'}",
                    "ms": p["p50_ms"], "err": (p["p50_ms"] - lo, hi - p["p50_ms"]), "color": PEER_COLOR})
    return out


def plot(rows: list[dict], out: Path, title: str, peer_from: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = bars(rows, peer_from)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.0 * len(specs)), 4.8))
    x = range(len(specs))
    ax.bar(x, [s["ms"] for s in specs], yerr=[[s["err"][0] for s in specs], [s["err"][1] for s in specs]],
           color=[s["color"] for s in specs], capsize=3)
    ax.set_xticks(list(x), [s["label"] for s in specs], fontsize=7)
    for i, s in enumerate(specs):
        ax.text(i, s["ms"], f"{s['ms']:.0f}", ha="center", va="bottom", fontsize=8)
    last_exact = next((r for r in reversed(rows) if not r.get("lossy") and r["steps"] == rows[0]["steps"]), rows[0])
    for key, style, name in (("floor_ms", ":", "compute floor"), ("practical_floor_ms", "--", "practical floor"),
                             ("target_ms", "-", "target")):
        if last_exact.get(key):
            ax.axhline(last_exact[key], linestyle=style, color="k", linewidth=0.8,
                       label=f"{name} {last_exact[key]:.0f} ms ({last_exact['steps']} steps, bf16)")
    ax.set_ylabel("end-to-end p50 latency (ms), 95 % CI")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    paths, notes = zip(*(f.split("::", 1) if "::" in f else (f, "") for f in args.files), strict=True)
    rows = load_rows([Path(p) for p in paths], list(notes))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    r0 = rows[0]
    title = args.title or (f"Cosmos 3 {r0['model']} DROID policy, tier {r0.get('tier', 480)}, batch 1, random weights, "
                           f"{r0.get('gpu', '?')} (bars labelled with the commit they ran at)")
    plot(rows, out, title, args.peer_from)
    print(f"{len(rows)} rows -> {out}")
    return 0
