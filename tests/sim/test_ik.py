"""The written-out rotation error against the cross-product form it replaces (sim/ik.py says why)."""

import numpy as np

from wamrt.sim.ik import rotation_error


def _rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    return q * np.sign(np.diag(r))


def test_rotation_error_is_bit_identical_to_the_cross_product_sum():
    rng = np.random.default_rng(0)
    for i in range(500):
        current = _rotation(rng)
        # far targets, and near ones (the IK loop's usual case: a few mrad off)
        target = _rotation(rng) if i % 2 else current @ _rotation_about(rng.normal(size=3), 1e-3 * rng.random())
        reference = 0.5 * sum(np.cross(current[:, k], target[:, k]) for k in range(3))
        assert np.array_equal(rotation_error(current, target), reference)


def test_rotation_error_is_the_small_angle_axis_angle():
    axis, angle = np.array([0.0, 0.6, 0.8]), 1e-4
    rot = _rotation_about(axis, angle)
    np.testing.assert_allclose(rotation_error(np.eye(3), rot), axis * angle, rtol=1e-6, atol=1e-12)
    assert np.array_equal(rotation_error(rot, rot), np.zeros(3))


def _rotation_about(axis: np.ndarray, angle: float) -> np.ndarray:
    axis = axis / np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k
