"""The lever table: each configuration's latency comes from its committed result file, which is the configuration it
claims to be, and d = ceil(latency / 66.7 ms)."""

from __future__ import annotations

import json
import math

import pytest

from wamrt.eval.levers import FIRST_STEP_ONLY, LEVERS, RESULTS, STEP_MS, delay_steps, table
from wamrt.pipeline.denoise import SamplingOptions
from wamrt.sampler import guidance_active


@pytest.mark.parametrize("lever", LEVERS, ids=lambda lv: f"{lv.size}-{lv.name}")
def test_each_lever_reads_its_own_configuration(lever):
    rec = json.loads((RESULTS / lever.result).read_text())
    assert rec["kind"] == "latency" and rec["gpu"] == "NVIDIA H200" and rec["model"] == lever.size
    assert rec["steps"] == lever.steps and rec["batch"] == 1 and not rec.get("pace_hz")
    assert rec["recipe"] == (lever.recipe or "bf16")
    assert ("interval" in rec["row"] or rec["row"] == "E8") == lever.interval
    assert lever.delay_steps() == math.ceil(rec["p50_ms"] / STEP_MS)


def test_delay_steps_and_the_issues_numbers():
    assert [delay_steps(ms) for ms in (49.0, 66.6, 66.7, 66.8, 145.1, 605.9)] == [1, 1, 2, 2, 3, 10]
    d = {(r["size"], r["name"]): r["delay_steps"] for r in table()}
    assert d[("edge", "bf16")] == 3 and d[("nano", "bf16")] == 10  # issue 41's Edge / Nano bf16 rows
    assert d[("edge", "gen-fp8-steps2")] == 1 and d[("nano", "interval")] == 6


@pytest.mark.parametrize("steps", sorted(FIRST_STEP_ONLY))
def test_first_step_only_interval_keeps_the_first_step(steps):
    timesteps = SamplingOptions(steps=steps).make_schedule().timesteps.tolist()
    assert guidance_active(timesteps, FIRST_STEP_ONLY[steps]) == [True] + [False] * (steps - 1)


def test_spec_suffixes():
    specs = {(lv.size, lv.name): lv.spec_suffix() for lv in LEVERS}
    assert specs[("edge", "bf16")] == "" and specs[("nano", "steps2")] == ":steps=2"
    assert specs[("edge", "gen-fp8-steps2-interval")] == ":steps=2,guidance_interval=833-1000"
