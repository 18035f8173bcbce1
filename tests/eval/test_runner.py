import json

import numpy as np

from wamrt.eval.agents import ExpertAgent, PolicyAgent, request_seed
from wamrt.eval.results import gate_result, rollout_result, write_result
from wamrt.eval.runner import run_rollouts
from wamrt.eval.stats import gate
from wamrt.sim.droid import EXTERIOR_KEYS, GRIPPER_KEY, JOINT_KEY, WRIST_KEY


class _Chunk:
    def __init__(self, actions: np.ndarray) -> None:
        self.actions = actions


class HoldPolicy:
    """A dummy policy of the real interface: holds the current joints, gripper open; records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple]] = []

    def infer(self, obs, *, seed=None):
        assert obs[WRIST_KEY].shape == (256, 448, 3) and obs[EXTERIOR_KEYS[1]].dtype == np.uint8
        assert obs[JOINT_KEY].shape == (7,) and np.ndim(obs[GRIPPER_KEY]) == 0 and isinstance(obs["prompt"], str)
        self.calls.append((seed, obs[WRIST_KEY].shape))
        return _Chunk(np.tile(np.r_[obs[JOINT_KEY], 0.0], (32, 1)).astype(np.float32))


SHARED = HoldPolicy()


def test_runner_with_dummy_policy_threads(tmp_path):
    SHARED.calls.clear()
    results = run_rollouts("lift", lambda: PolicyAgent(SHARED, execute_steps=8), [5, 6], lanes=2,
                           backend="thread", max_steps=20)
    assert [r.seed for r in results] == [5, 6]
    for r in results:
        assert r.error is None and not r.success and r.steps == 20 and r.requests == 3  # 8 + 8 + 4 rows
        assert r.stage == "never_reached"  # holding the home pose never comes near the cube
    assert sorted(s for s, _ in SHARED.calls) == sorted(request_seed(e, k) for e in (5, 6) for k in range(3))
    res = rollout_result("lift", "hold", results, {"execute_steps": 8}, command="test")
    for key in ("kind", "git_sha", "command", "date", "gpu", "torch", "task", "policy", "episodes", "successes",
                "success_rate", "ci95", "seeds", "config"):
        assert key in res
    assert res["kind"] == "rollout" and res["successes"] == 0 and res["ci95"][0] == 0.0
    back = json.loads(write_result(res, tmp_path / "r.json").read_text())
    assert back["seeds"] == {"first": 5, "last": 6}


def test_runner_expert_process_lanes_and_gate():
    seeds = [0, 1, 2]
    results = run_rollouts("lift", ExpertAgent, seeds, lanes=2, backend="process")
    assert all(r.success and r.error is None and r.stage == "success" for r in results)
    ok = [r.success for r in results]
    d = gate(ok, ok)
    res = gate_result("lift", "expert", "expert", seeds, ok, ok, d, {}, command="test")
    # 3 identical outcomes: no evidence of a loss, but too few episodes to bound it within 5 points.
    assert res["kind"] == "gate" and res["verdict"] == "inconclusive" and res["p_value"] == 1.0
    for key in ("baseline", "candidate", "episodes", "baseline_successes", "candidate_successes", "diff_ci95"):
        assert key in res


def test_request_seeds_are_stable():
    assert request_seed(3, 0) == request_seed(3, 0) != request_seed(3, 1)
    assert 0 <= request_seed(123, 4) < 2**31


def test_progress_stages_follow_the_expert_partway():
    """The expert cut off early has not reached the cube yet, cut off half-way it has; the thresholds map
    progress to the stage names."""
    from wamrt.eval.runner import EpisodeProgress, run_episode
    from wamrt.sim.env import PandaEnv

    with PandaEnv("pick_place", render=False) as env:
        full = run_episode(env, ExpertAgent(), 3)
        assert full.success and full.stage == "success"
        stages = [run_episode(env, ExpertAgent(), 3, max_steps=n).stage for n in (5, full.steps // 2)]
        assert stages[0] == "never_reached"
        env.reset(3, render=False)
        progress = EpisodeProgress(env)
        progress.max_rise_m = 0.05
        assert progress.stage(False) == "lifted_not_placed" and progress.stage(True) == "success"
        progress.max_rise_m, progress.min_tcp_cube_m = 0.0, 0.01
        assert progress.stage(False) == "reached_not_lifted"
    assert stages[1] in ("reached_not_lifted", "lifted_not_placed")


def test_milestones_time_each_phase_of_an_expert_episode():
    """The expert reaches the cube before it lifts it and lifts it before it succeeds; the summary's phase medians
    are the differences of those steps, and an episode cut off before the lift has no lift or success step."""
    from wamrt.eval.runner import phase_steps_median, run_episode
    from wamrt.sim.env import PandaEnv

    with PandaEnv("pick_place", render=False) as env:
        full = run_episode(env, ExpertAgent(), 3)
        m = full.milestones
        assert full.success and 0 < m["reach"] < m["lift"] < m["success"] == full.steps
        cut = run_episode(env, ExpertAgent(), 3, max_steps=m["lift"] - 1)
    assert cut.milestones == {"reach": m["reach"], "lift": None, "success": None}
    spans = phase_steps_median([full, cut])
    assert spans == {"reach": float(m["reach"]), "reach_to_lift": float(m["lift"] - m["reach"]),
                     "lift_to_success": float(m["success"] - m["lift"])}
