import ast
from pathlib import Path

import numpy as np
import pytest

from wamrt.sim import TASKS, PandaEnv, ScriptedExpert
from wamrt.sim.droid import EXTERIOR_KEYS, GRIPPER_KEY, JOINT_KEY, WRIST_KEY, droid_observation
from wamrt.sim.scene import CUBE_HALF
from wamrt.sim.tasks import COLOURS, cube_lifted, cube_on_pad, sample_layout

SRC = Path(__file__).resolve().parents[2] / "src" / "wamrt"


def _constants(path: Path) -> dict:
    """Module-level string/tuple constants, read without importing (the pipeline pulls in torch)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def test_observation_keys_match_the_policy_contract():
    canvas = _constants(SRC / "pipeline" / "canvas.py")
    assert canvas["WRIST_KEY"] == WRIST_KEY
    assert tuple(canvas["EXTERIOR_KEYS"]) == EXTERIOR_KEYS
    sample = (SRC / "sample.py").read_text()
    assert f'"{JOINT_KEY}"' in sample and f'"{GRIPPER_KEY}"' in sample


def test_render_shapes_and_droid_dict():
    with PandaEnv("pick_place") as env:
        obs = env.reset(0)
        assert obs.images["front"].shape == (128, 224, 3) and obs.images["front"].dtype == np.uint8
        assert obs.images["side"].shape == (128, 224, 3)
        assert obs.images["wrist"].shape == (256, 448, 3)
        assert obs.images["front"].std() > 5  # not a blank frame
        d = droid_observation(obs)
        assert d[WRIST_KEY].shape == (256, 448, 3)
        assert d[JOINT_KEY].shape == (7,) and d[JOINT_KEY].dtype == np.float32
        assert d[GRIPPER_KEY].dtype == np.float32 and 0.0 <= float(d[GRIPPER_KEY]) <= 0.05  # starts open
        assert d["prompt"] == "put the " + env.layout.colours[0] + " cube on the green pad"
        assert env.step(np.r_[obs.joint_position, 0.0], render=False).images == {}


def test_layouts_are_seeded():
    spec = TASKS["pick_place_two"]
    a, b, c = sample_layout(spec, 7), sample_layout(spec, 7), sample_layout(spec, 8)
    assert np.array_equal(a.cube_xy, b.cube_xy) and a.instruction == b.instruction
    assert not np.array_equal(a.cube_xy, c.cube_xy)
    targets = {sample_layout(spec, s).target for s in range(20)}
    assert targets == {0, 1}  # both cubes get named
    for s in range(20):
        lay = sample_layout(spec, s)
        assert len(set(lay.colours)) == 2 and lay.colours[lay.target] in lay.instruction
        assert set(lay.colours) <= set(COLOURS)
        assert np.linalg.norm(lay.cube_xy[0] - lay.cube_xy[1]) >= 0.16


def test_same_seed_same_episode():
    runs = []
    for _ in range(2):
        with PandaEnv("lift") as env:
            obs = env.reset(3)
            expert = ScriptedExpert()
            expert.reset(env)
            for _ in range(12):
                obs = env.step(expert.act(env), render=False)
            obs = env.observe()
            runs.append((env.data.qpos.copy(), obs.images["front"], obs.images["wrist"]))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert np.array_equal(runs[0][1], runs[1][1]) and np.array_equal(runs[0][2], runs[1][2])


def test_success_predicates():
    pad = np.array([0.5, 0.0])
    assert cube_on_pad(np.array([0.52, -0.03, CUBE_HALF]), pad, cube_touches_gripper=False)
    assert not cube_on_pad(np.array([0.52, -0.03, CUBE_HALF]), pad, cube_touches_gripper=True)  # still held
    assert not cube_on_pad(np.array([0.60, 0.0, CUBE_HALF]), pad, cube_touches_gripper=False)  # outside
    assert not cube_on_pad(np.array([0.5, 0.0, CUBE_HALF + 0.05]), pad, cube_touches_gripper=False)  # in air
    assert cube_lifted(np.array([0.5, 0.0, CUBE_HALF + 0.11]))
    assert not cube_lifted(np.array([0.5, 0.0, CUBE_HALF + 0.05]))
    with PandaEnv("pick_place", render=False) as env:
        env.reset(0)
        assert not env.success()  # the cube never starts on the pad


@pytest.mark.parametrize(("task", "episodes"),
                         [("lift", 10), ("pick_place", 8), ("pick_place_two", 6), ("turntable", 6)])
def test_expert_succeeds(task, episodes):
    ok = 0
    with PandaEnv(task, render=False) as env:
        expert = ScriptedExpert()
        for seed in range(1000, 1000 + episodes):
            env.reset(seed, render=False)
            expert.reset(env)
            for _ in range(env.spec.max_steps):
                env.step(expert.act(env), render=False)
                if env.success():
                    ok += 1
                    break
    assert ok / episodes >= 0.9, f"{task}: expert {ok}/{episodes}"


def test_dart_noise_moves_the_arm_but_records_the_experts_actions():
    from wamrt.sim.record import JointNoise, record_episode

    noise = JointNoise(0.02, seed=7)
    draws = np.stack([noise(np.zeros(8, np.float32)) for _ in range(4000)])
    assert np.all(draws[:, 7] == 0)  # the gripper is never perturbed
    assert 0.015 < draws[:, :7].std() < 0.025  # stationary std ~ sigma
    again = JointNoise(0.02, seed=7)
    assert np.array_equal(draws[0], again(np.zeros(8, np.float32)))  # seeded per episode
    with pytest.raises(ValueError, match="sigma"):
        JointNoise(-0.1, seed=0)

    with PandaEnv("pick_place", cameras=("front",), exterior_hw=(32, 32)) as env:
        expert = ScriptedExpert()
        clean, ok_clean = record_episode(env, expert, 100000)
        noisy, ok_noisy = record_episode(env, expert, 100000, action_noise=0.02)
        # Replaying the clean run without noise reproduces it exactly: the noise is the only difference.
        again, _ = record_episode(env, expert, 100000, action_noise=0.0)
    assert ok_clean and ok_noisy
    assert np.array_equal(clean["joint_position"], again["joint_position"])
    n = min(len(clean["actions"]), len(noisy["actions"]))
    assert np.abs(clean["joint_position"][:n] - noisy["joint_position"][:n]).max() > 0.01
    # The labels pull back toward the expert's path: they differ from the perturbed next state by more
    # than the clean run's own tracking lag.
    lag = lambda a: np.abs(a["actions"][:-1, :7] - a["joint_position"][1:]).mean()  # noqa: E731
    assert lag(noisy) > 1.2 * lag(clean)


def test_turntable_carries_the_cube_at_its_seeded_speed():
    with PandaEnv("turntable", render=False) as env:
        obs = env.reset(5, render=False)
        lay = env.layout
        centre, start = lay.turntable_xy, env.cube_pos(0)
        assert 0.35 <= lay.turntable_speed <= 0.55 and env.on_turntable(0)
        pad_to_disc = np.linalg.norm(lay.pad_xy - centre)
        assert pad_to_disc > 0.2  # the pad is never on the disc
        for _ in range(30):  # 2 s with the arm holding still
            env.step(np.r_[obs.joint_position, 0.0], render=False)
        end = env.cube_pos(0)
        turned = np.arctan2(*(end[:2] - centre)[::-1]) - np.arctan2(*(start[:2] - centre)[::-1])
        turned = turned % (2 * np.pi)
        assert abs(turned - 2.0 * lay.turntable_speed) < 0.1 * lay.turntable_speed  # rides along, no slip
        assert abs(np.linalg.norm(end[:2] - centre) - np.linalg.norm(start[:2] - centre)) < 0.003


def test_actuation_noise_is_seeded_and_moves_the_arm():
    def run(noise: float, seed: int) -> np.ndarray:
        with PandaEnv("pick_place", render=False, actuation_noise=noise) as env:
            obs = env.reset(seed, render=False)
            for _ in range(10):
                env.step(np.r_[obs.joint_position, 0.0], render=False)
            return env.joint_position()

    clean, a, b, other = run(0.0, 3), run(0.02, 3), run(0.02, 3), run(0.02, 4)
    assert np.array_equal(a, b)  # the same episode seed draws the same noise
    assert np.abs(a - clean).max() > 0.005 and not np.array_equal(a, other)
