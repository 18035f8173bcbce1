"""Result files in the schema of shared/docs/performance.md ("rollout" and "gate" kinds).

Common keys: kind, git_sha, command, date, gpu ("cpu" or the driver's name), torch. torch's version is read
from package metadata, so writing a result never imports torch.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..provenance import git_sha, utc_now
from .runner import EpisodeResult, summarize
from .stats import GateDecision, paired_bootstrap_ci, wilson_ci


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def common_fields(kind: str, gpu: str = "cpu", command: str | None = None) -> dict[str, Any]:
    return {"kind": kind, "git_sha": git_sha(), "command": command or shlex.join(sys.argv),
            "date": utc_now(), "gpu": gpu, "torch": _torch_version()}


def _seeds_field(seeds: Sequence[int]) -> dict[str, int] | list[int]:
    s = list(seeds)
    contiguous = s == list(range(s[0], s[0] + len(s))) if s else False
    return {"first": s[0], "last": s[-1]} if contiguous else s


def rollout_result(task: str, policy: str, results: Sequence[EpisodeResult], config: dict[str, Any], *,
                   gpu: str = "cpu", command: str | None = None) -> dict[str, Any]:
    n = len(results)
    k = sum(r.success for r in results)
    lo, hi = wilson_ci(k, n)
    out = common_fields("rollout", gpu, command)
    out.update(task=task, policy=policy, episodes=n, successes=k, success_rate=k / n if n else 0.0,
               ci95=[lo, hi], seeds=_seeds_field([r.seed for r in results]), config=config)
    out["summary"] = summarize(results)
    if any(r.realtime is not None for r in results):  # delay mode: stalls, delays, steps to success, jerk
        from .realtime import summarize_realtime

        out["realtime"] = summarize_realtime(results)
    out["outcomes"] = [int(r.success) for r in results]  # per seed, in seed order: enables later pairing
    out["stages"] = [r.stage for r in results]  # per seed: how far each episode got (runner.EpisodeProgress)
    if any(r.milestones for r in results):  # per seed: the step each phase was first reached (null: never)
        out["milestones"] = [r.milestones for r in results]
    if any(r.trace for r in results):  # per seed, space-joined request digests: a later run can check its replay
        out["traces"] = [" ".join(r.trace) for r in results]
    return out


def gate_result(task: str, baseline: str, candidate: str, seeds: Sequence[int], base_ok: Sequence[bool],
                cand_ok: Sequence[bool], decision: GateDecision, config: dict[str, Any], *, gpu: str = "cpu",
                command: str | None = None, replay: dict[str, Any] | None = None) -> dict[str, Any]:
    out = common_fields("gate", gpu, command)
    t = decision.table
    out.update(task=task, baseline=baseline, candidate=candidate, episodes=t.n,
               baseline_successes=t.both + t.baseline_only, candidate_successes=t.both + t.candidate_only,
               p_value=decision.p_value, diff_ci95=list(decision.diff_ci95), verdict=decision.verdict,
               diff=decision.diff, diff_ci_method="newcombe-paired-wilson (1998, method 10)",
               diff_ci95_bootstrap=list(paired_bootstrap_ci(base_ok, cand_ok)),
               discordant={"baseline_only": t.baseline_only, "candidate_only": t.candidate_only},
               test="exact McNemar (two-sided sign test on discordant pairs)",
               seeds=_seeds_field(seeds), config=config,
               outcomes={"baseline": [int(x) for x in base_ok], "candidate": [int(x) for x in cand_ok]})
    if replay is not None:  # eval.replay.compare_traces: did the two sides replay each other request by request?
        out["replay"] = replay
    return out


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2) + "\n")
    return p
