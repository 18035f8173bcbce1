"""A synthetic DROID observation (three camera views with simple shapes) for demos and smoke tests."""

from __future__ import annotations

import numpy as np

INSTRUCTION = "put the red block in the blue bowl"


def _scene(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    img = np.empty((h, w, 3), dtype=np.uint8)
    img[:] = rng.integers(90, 140, size=3, dtype=np.uint8)  # table colour
    yy, xx = np.mgrid[:h, :w]
    for colour in ((200, 30, 30), (30, 60, 200), (40, 170, 60)):
        cy, cx, r = rng.integers(h // 5, 4 * h // 5), rng.integers(w // 5, 4 * w // 5), rng.integers(h // 12, h // 6)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = colour
    return img


def sample_observation(seed: int = 0) -> dict:
    """openpi-style DROID observation: wrist 360x640 + two 180x320 exteriors, 7 joints, gripper."""
    rng = np.random.default_rng(seed)
    return {
        "prompt": INSTRUCTION,
        "observation/wrist_image_left": _scene(360, 640, rng),
        "observation/exterior_image_1_left": _scene(180, 320, rng),
        "observation/exterior_image_2_left": _scene(180, 320, rng),
        "observation/joint_position": np.array([0.0, -0.6, 0.0, -2.4, 0.0, 1.8, 0.8], dtype=np.float32)
        + rng.normal(0, 0.05, 7).astype(np.float32),
        "observation/gripper_position": np.float32(0.1),
    }
