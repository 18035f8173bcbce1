"""Prefix-conditioned requests (`action_prefix`): validation, the packing, the reply's first rows, both modes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from wamrt import load_policy
from wamrt.pipeline.droid import prepare_droid, run_droid
from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.normalization import ActionNormalization
from wamrt.pipeline.prefix import (
    GUIDANCE_CLIP,
    MAX_PREFIX_ROWS,
    ActionAnchor,
    guidance_weight,
    guided_velocity,
    parse_action_prefix,
)
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


@pytest.mark.parametrize("mode", ["clean", "inpaint", "guided"])
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
    assert policy.metadata()["action_prefix"] == {"max_rows": 16, "modes": ["auto", "clean", "inpaint", "guided"],
                                                  "auto": "inpaint", "trained_with_action_prefix": False}


def test_checkpoint_flag_is_read_and_checked():
    from wamrt.pipeline.policy import contract_from_config

    assert contract_from_config({"trained_with_action_prefix": True}).trained_with_action_prefix
    assert not contract_from_config({}).trained_with_action_prefix
    with pytest.raises(RequestError) as err:
        contract_from_config({"trained_with_action_prefix": "yes"})
    assert err.value.field == "trained_with_action_prefix"


GUIDED_TOL = 1e-5  # the VJP against the closed form on a linear velocity field (float32)


def test_guidance_weight_follows_rtc_schedule():
    """min(beta, (1 - t) / t / r^2), r^2 = (1 - t)^2 / (t^2 + (1 - t)^2), t = 1 - sigma, which is
    (t^2 + (1 - t)^2) / (t (1 - t)): smallest (2) at sigma = 0.5, symmetric, clipped at beta = 5 towards both
    full noise (where it diverges) and clean."""
    assert guidance_weight(1.0) == GUIDANCE_CLIP == 5.0
    assert guidance_weight(0.5) == pytest.approx(2.0)
    assert guidance_weight(0.7) == pytest.approx((0.09 + 0.49) / 0.21) == pytest.approx(guidance_weight(0.3))
    assert guidance_weight(0.9) == guidance_weight(0.1) == 5.0
    assert min(guidance_weight(s / 100) for s in range(1, 100)) == pytest.approx(2.0)


def test_guided_velocity_is_the_vjp_of_the_clean_estimate():
    """On a linear velocity field v(x) = x A + b the clean estimate x - sigma v(x) has the Jacobian I - sigma A,
    so the correction is (error)(I - sigma A)^T, subtracted with the weight: the closed form, and an Euler step
    with it lands the clean estimate nearer the anchored rows than a step without."""
    torch.manual_seed(0)
    rows, width, sigma = 6, 4, 0.7
    a, b = 0.3 * torch.randn(width, width), torch.randn(width)
    velocity = lambda x: x @ a + b  # noqa: E731
    x = torch.randn(1, rows, width)
    target = torch.zeros(1, rows, width)
    target[0, 1:3] = torch.randn(2, width)
    weight = torch.zeros(1, rows, 1)
    weight[0, 1:3] = 1.0
    anchor = ActionAnchor(target, torch.zeros_like(target), weight.bool(), weight)
    got = guided_velocity(velocity, x, sigma, anchor)
    error = (target - (x - sigma * velocity(x))) * weight
    want = velocity(x) - guidance_weight(sigma) * error @ (torch.eye(width) - sigma * a).T
    torch.testing.assert_close(got, want, rtol=0, atol=GUIDED_TOL)

    def clean_after_step(v: torch.Tensor) -> float:
        x_next, sigma_next = x + (0.5 - sigma) * v, 0.5
        return float(((x_next - sigma_next * velocity(x_next) - target) * weight).abs().sum())

    assert clean_after_step(got) < clean_after_step(velocity(x))


def test_guided_prefix_moves_the_free_rows_and_keeps_the_state_row(policy):
    """The tiny model through the eager reference: "guided" differs from "inpaint" beyond the prefix (the
    correction reached the free rows), its prefix rows equal the request's, and the clean state row is untouched."""
    obs = sample_observation(1)
    prefix = policy.infer(obs, seed=4, steps=2).actions[:5] + np.float32(0.05)
    kw = dict(model=policy.model, encoder=policy.encoder, tokenizer=policy.tokenizer, contract=policy.contract,
              options=policy.options.updated(steps=2), seed=4)
    out = {}
    for mode in ("inpaint", "guided"):
        chunk, prep, result = run_droid(dict(obs, action_prefix=prefix, action_prefix_mode=mode), **kw)
        out[mode] = chunk.actions
        assert chunk.prefix_mode == mode and np.abs(chunk.actions[:5] - prefix).max() <= PREFIX_TOL
        torch.testing.assert_close(result.action[0, 0], prep.inputs.action[0, 0], rtol=0, atol=0)
    assert np.abs(out["guided"][5:] - out["inpaint"][5:]).max() > 1e-4


def test_the_engine_refuses_a_guided_prefix_naming_the_field(policy):
    """The engine's graphs have no backward pass: a guided request gets a RequestError in its own slot, and the
    request beside it in the batch is answered."""
    from wamrt.engine import Engine, EngineConfig

    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    obs = sample_observation(0)
    guided = dict(obs, action_prefix=np.zeros((3, 8), np.float32), action_prefix_mode="guided")
    bad, good = engine.infer_batch([guided, obs], seeds=[1, 2], steps=1)
    assert isinstance(bad, RequestError) and bad.field == "action_prefix_mode" and "eager" in str(bad)
    assert good.actions.shape == (32, 8)
    assert engine.metadata()["action_prefix"]["modes"] == ["auto", "clean", "inpaint"]  # what it accepts
