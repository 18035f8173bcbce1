"""Task definitions: seeded layouts, instructions and success predicates on simulator state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scene import CUBE_HALF, PAD_HALF, TABLE_Z, TURNTABLE_RADIUS

# Colours a cube can take; the pad is always green so "the green pad" never collides with a cube colour.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.1, 0.1),
    "blue": (0.1, 0.25, 0.85),
    "yellow": (0.9, 0.8, 0.1),
    "purple": (0.55, 0.15, 0.7),
}
# Reachable, camera-visible region for cube and pad centres (robot base frame, metres).
X_RANGE = (0.38, 0.62)
Y_RANGE = (-0.22, 0.22)
LIFT_HEIGHT = 0.10  # lift: cube centre this far above its resting height
PLACE_TOL = PAD_HALF - 0.01  # pick_place: cube centre within this xy distance (per axis) of the pad centre


@dataclass(frozen=True)
class TaskSpec:
    name: str
    n_cubes: int
    uses_pad: bool
    max_steps: int  # at 15 Hz
    turntable: bool = False  # the cube rides a spinning disc: the world moves while the robot thinks
    reflexes: bool = False  # default of PandaEnv(reflexes=...): the controller's protective stop on target jumps


TASKS: dict[str, TaskSpec] = {
    "lift": TaskSpec("lift", 1, False, 120),
    "pick_place": TaskSpec("pick_place", 1, True, 225),
    "pick_place_two": TaskSpec("pick_place_two", 2, True, 225),
    "turntable": TaskSpec("turntable", 1, True, 225, turntable=True, reflexes=True),
}
# Turntable task: angular speed (rad/s, counter-clockwise seen from above) and the cube's distance from the axis
# (m), drawn per seed. 0.35-0.55 rad/s at 6-9 cm moves the cube 2-5 cm/s: 1.4-3.3 cm in the 10 control steps
# (0.67 s) of a Nano bf16 request, against a grasp that tolerates ~1.5 cm.
TURNTABLE_SPEED = (0.35, 0.55)
TURNTABLE_CUBE_R = (0.06, 0.09)


@dataclass(frozen=True)
class Layout:
    """Everything a seed decides. cube_xy/yaw/colours are per cube; `target` indexes the named cube."""

    cube_xy: np.ndarray  # [n, 2]
    cube_yaw: np.ndarray  # [n]
    colours: tuple[str, ...]
    target: int
    pad_xy: np.ndarray  # [2]; off the table view (far away) when the task has no pad
    joint_noise: np.ndarray  # [7] added to the home pose
    instruction: str
    turntable_xy: np.ndarray | None = None  # [2] disc centre (turntable task)
    turntable_speed: float = 0.0  # rad/s


def _sample_xy(rng: np.random.Generator, others: list[np.ndarray], min_dist: float) -> np.ndarray:
    for _ in range(1000):
        xy = np.array([rng.uniform(*X_RANGE), rng.uniform(*Y_RANGE)])
        if all(np.linalg.norm(xy - o) >= min_dist for o in others):
            return xy
    raise RuntimeError("layout sampling failed")  # unreachable for the ranges above


def _turntable_layout(spec: TaskSpec, seed: int) -> Layout:
    """Disc on one side of the workspace, pad on the other, the cube at a seeded radius and angle on the disc."""
    rng = np.random.default_rng([seed, 0x7AB1E])
    side = rng.choice([-1.0, 1.0])
    centre = np.array([rng.uniform(0.47, 0.53), side * rng.uniform(0.08, 0.11)])
    radius, angle = rng.uniform(*TURNTABLE_CUBE_R), rng.uniform(0.0, 2 * np.pi)
    cube_xy = centre + radius * np.array([np.cos(angle), np.sin(angle)])
    clear = TURNTABLE_RADIUS + PAD_HALF * np.sqrt(2) + 0.01  # the pad never overlaps the disc
    for _ in range(1000):
        pad_xy = np.array([rng.uniform(0.40, 0.60), -side * rng.uniform(0.14, 0.20)])
        if np.linalg.norm(pad_xy - centre) >= clear:
            break
    else:  # unreachable for the ranges above
        raise RuntimeError("layout sampling failed")
    colour = str(rng.choice(list(COLOURS)))
    yaw = rng.uniform(-np.pi / 4, np.pi / 4, size=1)
    noise = rng.uniform(-0.08, 0.08, size=7)
    return Layout(cube_xy[None], yaw, (colour,), 0, pad_xy, noise, f"put the {colour} cube on the green pad",
                  centre, float(rng.uniform(*TURNTABLE_SPEED)))


def sample_layout(spec: TaskSpec, seed: int) -> Layout:
    """Seeded randomisation: object positions, yaw, colours, which cube is named, arm start pose."""
    if spec.turntable:
        return _turntable_layout(spec, seed)
    rng = np.random.default_rng([seed, 0x57A5])  # a fixed second word keeps task streams apart from others
    placed: list[np.ndarray] = []
    pad_xy = np.array([0.0, 1.2])  # parked out of view
    if spec.uses_pad:
        pad_xy = _sample_xy(rng, placed, 0.0)
        placed.append(pad_xy)
    cube_xy = []
    for _ in range(spec.n_cubes):
        # Cubes start clear of the pad (so success is never free) and of each other (so grasps are clean).
        xy = _sample_xy(rng, placed, 0.16)
        placed.append(xy)
        cube_xy.append(xy)
    names = list(COLOURS)
    colours = tuple(str(c) for c in rng.choice(names, size=spec.n_cubes, replace=False))
    yaw = rng.uniform(-np.pi / 4, np.pi / 4, size=spec.n_cubes)
    target = int(rng.integers(spec.n_cubes))
    noise = rng.uniform(-0.08, 0.08, size=7)
    colour = colours[target]
    if spec.name == "lift":
        text = f"pick up the {colour} cube"
    else:
        text = f"put the {colour} cube on the green pad"
    return Layout(np.array(cube_xy), yaw, colours, target, pad_xy, noise, text)


def cube_lifted(cube_pos: np.ndarray) -> bool:
    return bool(cube_pos[2] >= TABLE_Z + CUBE_HALF + LIFT_HEIGHT)


def cube_on_pad(cube_pos: np.ndarray, pad_xy: np.ndarray, cube_touches_gripper: bool) -> bool:
    """Resting on the table inside the pad, and released (a cube still held above the pad does not count)."""
    inside = bool(np.all(np.abs(cube_pos[:2] - pad_xy) <= PLACE_TOL))
    resting = bool(cube_pos[2] <= TABLE_Z + CUBE_HALF + 0.01)
    return inside and resting and not cube_touches_gripper
