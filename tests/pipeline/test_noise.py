from __future__ import annotations

import numpy as np
import pytest

from wamrt.pipeline.errors import RequestError
from wamrt.pipeline.noise import (
    GRIPPER_KEY,
    JOINT_KEY,
    droid_state_row,
    initial_action,
    legacy_gaussian,
    state_row_from_observation,
    vision_noise,
)


def test_noise_state_and_action_init_match_fixture(droid_request, assert_bitwise) -> None:
    t, seed = droid_request.tensors, droid_request.request["seed"]
    assert droid_request.expected["seed"] == seed
    assert_bitwise(vision_noise(seed, t["noise_vision"].shape), t["noise_vision"], "noise_vision")
    state = state_row_from_observation(droid_request.observation)
    assert_bitwise(state, t["state_row"], "state_row")
    action = initial_action(state, seed)
    assert_bitwise(action.noise, t["noise_action"], "noise_action")
    assert_bitwise(action.x0, t["action_x0"], "action_x0")
    assert_bitwise(action.init, t["action_init"], "action_init")
    assert_bitwise(action.init, t["action_latents"][0], "action_latents[0]")


def test_action_noise_is_a_fresh_stream(droid_request) -> None:
    # Fresh RandomState per modality: the action draw equals the start of the vision draw.
    t = droid_request.tensors
    assert np.array_equal(t["noise_action"].ravel(), t["noise_vision"].ravel()[: t["noise_action"].size])
    other = legacy_gaussian(droid_request.request["seed"] + 1, (33, 64))
    assert not np.array_equal(other, t["noise_action"])


def test_state_row_uses_last_rows_and_flips_gripper_in_float32() -> None:
    joints = [[0.0] * 7, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]]
    row = droid_state_row(joints, [0.9, 0.3])
    assert row.dtype == np.float32 and row.shape == (8,)
    assert np.array_equal(row[:7], np.float32(joints[1]))
    assert row[7] == np.float32(1.0) - np.float32(0.3)
    assert np.array_equal(droid_state_row(joints[1], 0.3), row)
    assert np.array_equal(droid_state_row(joints[1], [[0.3]]), row)
    # Cast first, then flip: for this value float32(1 - x) differs from 1 - float32(x) by one ulp.
    g = 0.8132702392002724
    assert droid_state_row(joints[1], g)[7] == np.float32(1.0) - np.float32(g) != np.float32(1.0 - g)


def test_initial_action_layout() -> None:
    state = np.arange(1, 9, dtype=np.float32)
    a = initial_action(state, 123)
    assert a.x0.shape == a.init.shape == (33, 64)
    assert np.array_equal(a.init[0, :8], state) and not a.init[0, 8:].any()
    assert not a.init[1:, 8:].any() and not a.x0[1:].any()
    assert np.array_equal(a.init[1:, :8], a.noise[1:, :8])


@pytest.mark.parametrize(
    "joints, gripper, field",
    [
        (None, 0.5, JOINT_KEY),
        ([0.0] * 6, 0.5, JOINT_KEY),
        ([[[0.0] * 7]], 0.5, JOINT_KEY),
        ([[0.0] * 7, [0.0] * 8], 0.5, JOINT_KEY),  # ragged
        ([0.0] * 6 + [float("nan")], 0.5, JOINT_KEY),
        (np.zeros((0, 7)), 0.5, JOINT_KEY),
        (["a"] * 7, 0.5, JOINT_KEY),
        ([0.0] * 7, None, GRIPPER_KEY),
        ([0.0] * 7, float("inf"), GRIPPER_KEY),
        ([0.0] * 7, [[0.1, 0.2]], GRIPPER_KEY),
        ([0.0] * 7, [], GRIPPER_KEY),
    ],
)
def test_bad_state_raises_request_error(joints, gripper, field) -> None:
    with pytest.raises(RequestError) as info:
        droid_state_row(joints, gripper)
    assert info.value.field == field


def test_missing_observation_keys() -> None:
    with pytest.raises(RequestError) as info:
        state_row_from_observation({GRIPPER_KEY: 0.1})
    assert info.value.field == JOINT_KEY
    with pytest.raises(RequestError) as info:
        state_row_from_observation({JOINT_KEY: [0.0] * 7})
    assert info.value.field == GRIPPER_KEY


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "3", None])
def test_bad_seed(seed) -> None:
    with pytest.raises(RequestError):
        legacy_gaussian(seed, (2,))


def test_bad_state_vector() -> None:
    with pytest.raises(RequestError):
        initial_action(np.zeros(65, np.float32), 0)
    with pytest.raises(RequestError):
        initial_action(np.array([np.nan], np.float32), 0)
