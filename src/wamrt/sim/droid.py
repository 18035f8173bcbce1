"""Simulator observation -> the openpi DROID observation dict of the policy contract.

Keys as in `wamrt.pipeline.canvas` / `wamrt.sample`: the wrist view, two exterior views, 7 joint positions,
the gripper closure (0 open .. 1 closed) and the instruction. `compose_droid_canvas` stacks the wrist view
on top and the two exteriors, each resized to half the wrist size, below; the env renders the wrist at twice
the exterior size so that resize is an exact copy and no exterior pixel is lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .env import Observation

# Same strings as wamrt.pipeline.canvas (a test checks it). Not imported from there: that package pulls in
# torch and diffusers (tens of seconds), which simulator lanes must not pay for.
WRIST_KEY = "observation/wrist_image_left"
EXTERIOR_KEYS = ("observation/exterior_image_1_left", "observation/exterior_image_2_left")
JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
PROMPT_KEY = "prompt"


def droid_observation(obs: Observation) -> dict[str, Any]:
    """A missing "side" camera is replaced by the front view (the contract always has two exteriors)."""
    images = obs.images
    if "wrist" not in images or "front" not in images:
        raise ValueError(f"need rendered 'wrist' and 'front' cameras, got {sorted(images)}")
    return {
        WRIST_KEY: images["wrist"],
        EXTERIOR_KEYS[0]: images["front"],
        EXTERIOR_KEYS[1]: images.get("side", images["front"]),
        JOINT_KEY: np.asarray(obs.joint_position, dtype=np.float32),
        GRIPPER_KEY: np.float32(obs.gripper_position),
        PROMPT_KEY: obs.prompt,
    }
