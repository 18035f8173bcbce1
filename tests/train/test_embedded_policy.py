"""The embedded trained policy `panda-droid`: present, small, reproducible from what its wamrt.json records,
and served through the normalized DROID contract."""

from __future__ import annotations

import json

import numpy as np

import wamrt
from wamrt.pipeline.policy import TRAINED_MODELS

FOLDER = TRAINED_MODELS["panda-droid"]
LIMIT_MB = 60  # issue 12: the embedded checkpoint stays <= 60 MB


def test_embedded_policy_is_small_and_records_how_it_was_made():
    size = sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file()) / 1e6
    assert size <= LIMIT_MB, size
    meta = json.loads((FOLDER / "wamrt.json").read_text())
    assert meta["contract"] == "droid" and meta["tier"] == "256"
    assert len(meta["provenance"]["git_sha"]) == 40 and "gpu_pipeline.sh" in meta["provenance"]["command"]
    train = meta["train"]
    assert train["normalization"] == "relative" and train["seed"] == 0 and train["steps"] > 0
    assert "--aug-shift 0" in train["command"]


def test_embedded_policy_serves_raw_joint_targets_near_the_state():
    from wamrt.sample import sample_observation

    policy = wamrt.load_policy("panda-droid", device="cpu")
    assert policy.contract.normalization is not None and policy.contract.tier == "256"
    assert policy.metadata()["action_normalization"].startswith("per-row")
    obs = sample_observation()
    obs["observation/joint_position"] = np.array([0.0, -0.35, 0.0, -2.3, 0.0, 1.95, 0.785], np.float32)  # sim home
    chunk = policy.infer(obs, seed=0)
    assert chunk.actions.shape == (32, 8) and np.isfinite(chunk.actions).all()
    # relative actions: the first rows stay within a few control steps of motion of the current joints
    assert np.abs(chunk.actions[0, :7] - obs["observation/joint_position"]).max() < 0.3


def test_real_time_policy_is_embedded_and_takes_a_committed_prefix():
    """`panda-droid-rt` (issue 41): trained with clean action prefixes, its wamrt.json says so and records its
    lineage; a request with the rows the arm has committed to answers a chunk that starts from them."""
    from wamrt.sim import PandaEnv
    from wamrt.sim.droid import droid_observation

    folder = TRAINED_MODELS["panda-droid-rt"]
    meta = json.loads((folder / "wamrt.json").read_text())
    assert meta["trained_with_action_prefix"] and meta["action_prefix"]["max_rows"] >= 10
    assert "--init-from" in meta["train"]["command"] and "--dagger-repeat" in meta["train"]["command"]
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6
    assert size <= LIMIT_MB, size
    policy = wamrt.load_policy("panda-droid-rt", device="cpu")
    assert policy.contract.trained_with_action_prefix
    for task in ("pick_place", "turntable"):  # the simulator's own observations: what it was trained on
        with PandaEnv(task) as env:
            obs = droid_observation(env.reset(0))
        free = policy.infer(obs, seed=0).actions
        assert free.shape == (32, 8) and np.isfinite(free).all()
        committed = free[:6].copy()
        committed[:, :7] += 0.1  # rows the arm committed to, away from the ones this seed would draw
        chunk = policy.infer({**obs, "action_prefix": committed}, seed=1).actions
        assert np.allclose(chunk[:6], committed, atol=1e-4), task
        # the free rows continue from the committed ones, not from the plan the policy would have made without
        # them: the first free row is nearer the last committed row than the unconditioned chunk's row is
        follows = np.abs(chunk[6, :7] - committed[5, :7]).mean()
        ignores = np.abs(free[6, :7] - committed[5, :7]).mean()
        assert follows < ignores, (task, follows, ignores)
