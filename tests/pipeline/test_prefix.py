"""Prefix-conditioned requests (`action_prefix`): validation, the packing, the reply's first rows, both modes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from wamrt import load_policy
from wamrt.pipeline.droid import prepare_droid
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.normalization import ActionNormalization
from wamrt.pipeline.prefix import MAX_PREFIX_ROWS, parse_action_prefix
from wamrt.sample import sample_observation

PREFIX_TOL = 1e-5  # the reply's prefix rows vs the request's: float32 rounding of the normalization round trip


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    torch.set_num_threads(1)
    yield load_policy("tiny-droid", device="cpu")
    mp.undo()


@pytest.fixture(scope="module")
def normalized(policy):
    """tiny-droid with relative per-row statistics, as a policy trained by wamrt.train carries them."""
    rng = np.random.default_rng(0)
    norm = ActionNormalization.fit(rng.normal(0, 0.5, (64, 8)), rng.normal(0, 0.5, (64, 32, 8)),
                                   relative=(True,) * 7 + (False,))
    pol = load_policy("tiny-droid", device="cpu")
    pol.contract = replace(pol.contract, normalization=norm)
    return pol


@pytest.mark.parametrize("bad, field, match", [
    (np.zeros((3, 7)), "action_prefix", "shape"),
    (np.zeros(8), "action_prefix", "shape"),
    (np.zeros((MAX_PREFIX_ROWS + 1, 8)), "action_prefix", "at most"),
    (np.full((2, 8), np.nan), "action_prefix", "NaN"),
    ([["a"] * 8], "action_prefix", "numeric"),
])
def test_bad_prefix_is_a_request_error_naming_the_field(policy, bad, field, match):
    obs = dict(sample_observation(0), action_prefix=bad)
    with pytest.raises(RequestError, match=match) as err:
        policy.infer(obs, seed=1, steps=1)
    assert err.value.field == field


def test_bad_mode_is_a_request_error_naming_the_field():
    with pytest.raises(RequestError) as err:
        parse_action_prefix({"action_prefix": np.zeros((2, 8)), "action_prefix_mode": "soft"})
    assert err.value.field == "action_prefix_mode"


def test_empty_prefix_and_mode_alone_are_the_plain_request(policy):
    obs = sample_observation(0)
    plain = policy.infer(obs, seed=3, steps=2).actions
    for extra in ({"action_prefix": []}, {"action_prefix": np.zeros((0, 8))}, {"action_prefix_mode": "clean"}):
        got = policy.infer(dict(obs, **extra), seed=3, steps=2)
        assert np.array_equal(got.actions, plain) and got.prefix_rows == 0, extra


@pytest.mark.parametrize("mode", ["clean", "inpaint"])
@pytest.mark.parametrize("which", ["raw", "normalized"])
def test_reply_starts_with_the_prefix_and_continues(policy, normalized, mode, which):
    pol = policy if which == "raw" else normalized
    obs = sample_observation(1)
    plain = pol.infer(obs, seed=4, steps=2).actions
    prefix = plain[:6] + np.linspace(0.05, 0.1, 8, dtype=np.float32)  # committed rows that are not the model's
    got = pol.infer(dict(obs, action_prefix=prefix, action_prefix_mode=mode), seed=4, steps=2)
    assert np.abs(got.actions[:6] - prefix).max() <= PREFIX_TOL
    assert (got.prefix_rows, got.prefix_mode) == (6, mode)
    assert np.abs(got.actions[6:] - plain[6:]).max() > 1e-5  # the rest depends on the prefix
    assert np.isfinite(got.actions).all()


def test_clean_prefix_packing(normalized):
    """Clean mode: the prefix rows follow the state row as clean rows (action_noisy False), normalized with the
    statistics of chunk rows 0..d-1 and the joints relative to the request's state."""
    pol = normalized
    obs = sample_observation(2)
    prefix = np.random.default_rng(1).normal(0, 0.3, (4, 8)).astype(np.float32)
    prep = prepare_droid(dict(obs, action_prefix=prefix, action_prefix_mode="clean"), model=pol.model,
                         encoder=pol.encoder, tokenizer=pol.tokenizer, contract=pol.contract, seed=2,
                         device=torch.device("cpu"))
    inp = prep.inputs
    assert inp.action_noisy.tolist() == [[False] * 5 + [True] * 28]
    model_rows = prefix.copy()
    model_rows[:, -1] = 1 - model_rows[:, -1]  # gripper into model space
    want = pol.contract.normalization.actions_in(
        np.concatenate([model_rows, np.zeros((28, 8), np.float32)]), prep.state)[:4]
    anchor = inp.action_anchor
    torch.testing.assert_close(anchor.value[0, 1:5, :8], torch.from_numpy(want), rtol=0, atol=1e-6)
    assert anchor.mask[0, :, 0].tolist() == [False] + [True] * 4 + [False] * 28
    assert float(anchor.delta.abs().max()) == 0.0  # clean rows never re-noised


def test_auto_mode_follows_the_checkpoint(policy):
    obs = dict(sample_observation(0), action_prefix=np.zeros((2, 8), np.float32))
    assert policy.infer(obs, seed=1, steps=1).prefix_mode == "inpaint"
    trained = load_policy("tiny-droid", device="cpu")
    trained.contract = replace(trained.contract, trained_with_action_prefix=True)
    assert trained.infer(obs, seed=1, steps=1).prefix_mode == "clean"
    assert trained.metadata()["action_prefix"]["auto"] == "clean"
    assert policy.metadata()["action_prefix"] == {"max_rows": 16, "modes": ["auto", "clean", "inpaint"],
                                                  "auto": "inpaint", "trained_with_action_prefix": False}


def test_checkpoint_flag_is_read_and_checked():
    from wamrt.pipeline.policy import contract_from_config

    assert contract_from_config({"trained_with_action_prefix": True}).trained_with_action_prefix
    assert not contract_from_config({}).trained_with_action_prefix
    with pytest.raises(RequestError) as err:
        contract_from_config({"trained_with_action_prefix": "yes"})
    assert err.value.field == "trained_with_action_prefix"
