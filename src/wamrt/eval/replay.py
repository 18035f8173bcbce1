"""Do two rollouts of the same seeds replay each other? Request-by-request comparison of episode traces.

A trace entry is "<observation digest>:<actions digest>" (eval.agents.PolicyAgent). For the same seed, the first
entry where two runs differ says which side broke the replay: a different observation after identical actions is
the simulator (physics or rendering), identical observation but different actions is the policy server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any


def first_divergence(a: Sequence[str], b: Sequence[str]) -> tuple[int, str] | None:
    """(request index, "observation" | "actions" | "length") of the first difference, None if identical."""
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k, "observation" if x.split(":")[0] != y.split(":")[0] else "actions"
    return None if len(a) == len(b) else (min(len(a), len(b)), "length")


def compare_traces(baseline: Sequence[Sequence[str]], candidate: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Per-seed traces of two runs (same seeds, same order) -> how many episodes replayed exactly, and where and on
    which side the others first differed."""
    if len(baseline) != len(candidate):
        raise ValueError(f"traces of {len(baseline)} and {len(candidate)} episodes cannot be paired")
    kinds: Counter = Counter()
    at: list[int] = []
    for a, b in zip(baseline, candidate, strict=True):
        d = first_divergence(a, b)
        if d is not None:
            at.append(d[0])
            kinds[d[1]] += 1
    return {"episodes": len(baseline), "identical": len(baseline) - len(at),
            "first_divergence": dict(sorted(kinds.items())), "first_divergence_request": sorted(at)}


def parse_traces(stored: Sequence[str]) -> list[list[str]]:
    """A rollout file's `traces` field (one space-joined string per episode) -> per-episode lists."""
    return [s.split() for s in stored]


def describe(replay: dict[str, Any]) -> str:
    kinds = ", ".join(f"{v} at the {k}" for k, v in replay["first_divergence"].items()) or "none"
    return f"replay: {replay['identical']}/{replay['episodes']} episodes identical request by request; " \
           f"first differences: {kinds}"
