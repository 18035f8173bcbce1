"""Replay checks: two rollouts of the same seeds compared request by request."""

import json

import numpy as np
import pytest

from wamrt.eval.agents import PolicyAgent
from wamrt.eval.replay import compare_traces, describe, first_divergence, parse_traces
from wamrt.eval.results import rollout_result
from wamrt.eval.runner import run_rollouts
from wamrt.sim.droid import JOINT_KEY


def test_first_divergence_names_the_side_that_broke_the_replay():
    a = ["o1:a1", "o2:a2", "o3:a3"]
    assert first_divergence(a, list(a)) is None
    assert first_divergence(a, ["o1:a1", "o2:XX", "o9:a3"]) == (1, "actions")  # same observation, other actions
    assert first_divergence(a, ["o1:a1", "o9:a2", "o3:a3"]) == (1, "observation")  # the simulator differed
    assert first_divergence(a, a[:2]) == (2, "length")  # one episode ended earlier on identical requests
    rep = compare_traces([a, a, a], [a, ["o1:a1", "o2:XX"], ["o0:a1"]])
    assert rep["identical"] == 1 and rep["first_divergence"] == {"actions": 1, "observation": 1}
    assert rep["first_divergence_request"] == [0, 1]
    assert "1/3 episodes identical" in describe(rep)
    with pytest.raises(ValueError, match="cannot be paired"):
        compare_traces([a], [a, a])


class NoisyHold:
    """Holds the joints, plus noise drawn from the request seed: deterministic per (seed, observation)."""

    def __init__(self, salt: int = 0) -> None:
        self.salt = salt

    def infer(self, obs, *, seed=None):
        rng = np.random.default_rng([seed, self.salt])
        rows = np.tile(np.r_[obs[JOINT_KEY], 0.0], (32, 1)) + 0.01 * rng.standard_normal((32, 8))
        return type("Chunk", (), {"actions": rows.astype(np.float32)})()


def test_rollouts_record_traces_that_replay_exactly_and_catch_a_changed_policy():
    """The same deterministic policy replays bit for bit (the simulator too); another policy differs first at
    its actions, on the same first observation."""
    def run(salt: int):
        return run_rollouts("lift", lambda: PolicyAgent(NoisyHold(salt), execute_steps=8), [1, 2], lanes=2,
                            backend="thread", max_steps=16)

    first, again, other = run(0), run(0), run(1)
    assert all(len(r.trace) == r.requests == 2 for r in first)
    stored = rollout_result("lift", "hold", first, {}, command="test")["traces"]
    traces = parse_traces(json.loads(json.dumps(stored)))
    assert compare_traces(traces, [r.trace for r in again])["identical"] == 2
    rep = compare_traces(traces, [r.trace for r in other])
    assert rep["identical"] == 0 and rep["first_divergence"] == {"actions": 2}
    assert rep["first_divergence_request"] == [0, 0]
