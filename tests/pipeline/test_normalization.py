"""Checkpoint action normalization: exact round trip, fitted statistics, typed errors naming the field, and
the DROID contract applying it on the way in (state row) and undoing it on the way out (chunk)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wamrt.model.checkpoint import CheckpointError
from wamrt.pipeline.denoise import DenoiseResult
from wamrt.pipeline.droid import DroidContract, droid_actions
from wamrt.pipeline.normalization import MIN_STD, ActionNormalization

REL = (True,) * 7 + (False,)


def _fitted(seed: int = 0) -> tuple[ActionNormalization, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    states = rng.normal(0, 0.5, (200, 8)).astype(np.float32)
    spread = np.linspace(0.02, 0.4, 32)[:, None]  # per chunk row
    chunks = (states[:, None, :] * np.asarray(REL) + rng.normal(0, 1, (200, 32, 8)) * spread).astype(np.float32)
    chunks[..., 7] = rng.integers(0, 2, (200, 32))
    states[:, 6] = 0.3  # a joint that never moves: its std is floored, not zero
    return ActionNormalization.fit(states, chunks, REL), states, chunks


def test_round_trip_and_statistics():
    norm, states, chunks = _fitted()
    z = norm.actions_in(chunks, states)
    assert abs(z.mean()) < 1e-5 and np.abs(z.std(axis=0) - 1).max() < 1e-4  # per (row, column) standardised
    np.testing.assert_allclose(norm.actions_out(z, states), chunks, rtol=0, atol=1e-5)
    assert norm.state_std[6] == MIN_STD
    # the near rows keep their own (small) scale: offsets 2 s ahead spread ~20x more than the next step's
    assert norm.action_std[31][0] > 10 * norm.action_std[0][0]
    assert hash(norm) == hash(_fitted()[0])  # frozen and hashable: the engine's graph key holds the contract


def test_json_round_trip_and_errors_name_the_field():
    norm, _, _ = _fitted()
    assert ActionNormalization.from_json(norm.to_json(), raw_dim=8, chunk=32) == norm
    good = norm.to_json()
    cases = {
        "state_std": ({**good, "state_std": [1.0] * 7}, "must have shape"),
        "action_std": ({**good, "action_std": [[0.0] * 8] * 32}, "must be > 0"),
        "action_mean": ({**good, "action_mean": [[float("nan")] * 8] * 32}, "NaN"),
        "relative": ({**good, "relative": [1] * 8}, "booleans"),
        "state_mean": ({k: v for k, v in good.items() if k != "state_mean"}, "is missing"),
    }
    for field, (obj, why) in cases.items():
        with pytest.raises(CheckpointError, match=f"action_normalization.{field} .*{why}"):
            ActionNormalization.from_json(obj, raw_dim=8, chunk=32)
    with pytest.raises(CheckpointError, match="must be an object"):
        ActionNormalization.from_json([1, 2], raw_dim=8, chunk=32)


def test_contract_normalizes_the_state_row_and_denormalizes_the_chunk(tmp_path):
    """Through load_policy: a checkpoint whose wamrt.json carries statistics gets them in its contract; the
    request's state row enters the model normalized, and the model's rows leave as raw joint targets."""
    import json
    import shutil

    import wamrt
    from wamrt.pipeline.builtin import builtin_path
    from wamrt.pipeline.droid import prepare_droid
    from wamrt.sample import sample_observation

    norm, states, chunks = _fitted()
    folder = tmp_path / "ckpt"
    shutil.copytree(builtin_path("tiny-droid"), folder)
    meta = json.loads((folder / "wamrt.json").read_text())
    (folder / "wamrt.json").write_text(json.dumps({**meta, "action_normalization": norm.to_json()}))
    pol = wamrt.load_policy(folder)
    assert pol.contract.normalization == norm and pol.metadata()["action_normalization"]
    obs = sample_observation()
    prep = prepare_droid(obs, model=pol.model, encoder=pol.encoder, tokenizer=pol.tokenizer, contract=pol.contract,
                         seed=0, device=pol.device)
    assert np.array_equal(prep.inputs.action[0, 0, :8].numpy(), norm.state_in(prep.state))
    raw_state = prep.state
    assert raw_state is not None and np.isclose(raw_state[7], 1 - float(obs["observation/gripper_position"]))
    # the model's normalized rows -> raw model-space rows -> gripper flipped back
    z = norm.actions_in(chunks[0], raw_state)
    rows = torch.zeros(1, 33, 64)
    rows[0, 1:, :8] = torch.from_numpy(z)
    out = droid_actions(DenoiseResult(None, rows), pol.contract, raw_state)
    expect = chunks[0].copy()
    expect[:, 7] = 1 - expect[:, 7]
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="state row"):
        droid_actions(DenoiseResult(None, rows), pol.contract)
    # the served chunk is finite and in raw units (the joints near the request's state, not near 0)
    chunk = pol.infer(obs, seed=1)
    assert chunk.actions.shape == (32, 8) and np.isfinite(chunk.actions).all()
    # a checkpoint without statistics keeps the released contract exactly
    assert DroidContract().normalization is None
