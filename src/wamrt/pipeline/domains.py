"""Embodiment domain registry of the generic action contracts (diffusers 0.42.1 semantics).

A domain selects the rows of the transformer's domain-aware action projections and fixes the raw
(unpadded) action width; predicted actions are sliced to that width and padded columns are kept at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from wamrt.pipeline.errors import RequestError

# Data constants copied from diffusers 0.42.1 `pipelines/cosmos/pipeline_cosmos3_omni.py`
# (_EMBODIMENT_TO_DOMAIN_ID): several names share an id (they share projection weights).
DOMAIN_IDS: dict[str, int] = {
    "no_action": 0,
    "av": 1,
    "camera_pose": 2,
    "hand_pose": 3,
    "pusht": 4,
    "libero": 5,
    "umi": 6,
    "bridge_orig_lerobot": 7,
    "droid_lerobot": 8,
    "robomind-franka": 8,
    "galbot": 9,
    "robomind-franka-dual": 12,
    "robomind-ur": 13,
    "agibotworld": 15,
    "agibot_gear_gripper": 15,
    "agibot_gear_gripper_ext": 15,
    "fractal": 20,
}

# Same source (_EMBODIMENT_TO_RAW_ACTION_DIM). `no_action` and `libero` have ids but no fixed width,
# so diffusers refuses them for action inference, and so do we.
RAW_ACTION_DIMS: dict[str, int] = {
    "av": 9,
    "camera_pose": 9,
    "pusht": 2,
    "umi": 10,
    "bridge_orig_lerobot": 10,
    "droid_lerobot": 10,
    "robomind-franka": 10,
    "robomind-franka-dual": 20,
    "robomind-ur": 10,
    "galbot": 30,
    "agibotworld": 29,
    "agibot_gear_gripper": 29,
    "agibot_gear_gripper_ext": 29,
    "fractal": 10,
    "hand_pose": 57,
}


@dataclass(frozen=True)
class Domain:
    name: str
    domain_id: int  # row of the domain-aware action projections
    raw_action_dim: int  # unpadded action width in model space


def action_domains() -> tuple[str, ...]:
    """Names usable for action inference (a registered id and a fixed width)."""
    return tuple(sorted(RAW_ACTION_DIMS))


def resolve_domain(name: object) -> Domain:
    if not isinstance(name, str) or name not in DOMAIN_IDS:
        raise RequestError(
            f"unknown embodiment domain {name!r}; expected one of {list(action_domains())}", field="domain"
        )
    if name not in RAW_ACTION_DIMS:
        raise RequestError(
            f"domain {name!r} has no fixed action width and is not supported for action "
            f"inference; expected one of {list(action_domains())}",
            field="domain",
        )
    return Domain(name, DOMAIN_IDS[name], RAW_ACTION_DIMS[name])
