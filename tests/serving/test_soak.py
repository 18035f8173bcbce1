"""`wamrt bench soak` in small: 300 mixed requests against `wamrt serve --model tiny-world` in its own process.
The committed 10 000-request result is bench/results/soak/; this checks the bench itself and the bars that hold
at any size (no 5xx, every malformed request a typed 4xx, every kind of traffic sent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wamrt.bench.soak_traffic import MALFORMED, MIX
from wamrt.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_soak_300(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    main(["bench", "soak", "--requests", "300", "--baseline", "100", "--out", str(out)])  # exit 1 = a bar missed
    r = json.loads(out.read_text())
    assert r["kind"] == "soak" and r["requests"] == 300 and r["baseline_requests"] == 100
    assert r["status_5xx"] == 0, r["status_counts"]
    for kind, statuses in r["by_kind"].items():
        if kind.startswith("malformed"):
            assert all(400 <= int(s.split()[0]) < 500 and s.split()[1] != "untyped" for s in statuses), (kind, statuses)
    sent = {k.removeprefix("malformed_") for k in r["by_kind"]}
    assert set(MIX) - {"malformed"} <= sent and any(f.__name__.lstrip("_") in sent for f in MALFORMED)
    assert r["rss_growth_pct"] < 25.0  # the bar (5 %) is for the 10 000-request run; 300 still warm caches up
    assert r["policy_with_bad_traffic"]["n"] > 50 and r["policy_without_bad_traffic"]["n"] > 20
