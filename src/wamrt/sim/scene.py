"""The MJCF scene: the vendored Panda on a table, task cubes, a target pad and three cameras.

The model is built as an XML string with the robot and meshes passed through MuJoCo's in-memory asset
dict, so nothing depends on the working directory. Object poses and colours are *not* baked in: a task
places them at reset, so one compiled model serves every seed of a task.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).parent / "assets" / "panda"
CUBE_HALF = 0.025  # 5 cm cubes: the gripper opens to 8 cm, and they stay visible at 128 px
PAD_HALF = 0.06  # 12 x 12 cm target pad
TABLE_Z = 0.0  # the robot base stands on the table top
# The turntable task's disc: thin (so fingers closing on a cube at its rim clear the top), wide enough for a
# cube at 10 cm from the axis. Its centre is placed per seed at reset (the body's model position).
TURNTABLE_RADIUS = 0.14
TURNTABLE_TOP = 0.012


@dataclass(frozen=True)
class Camera:
    name: str
    pos: tuple[float, float, float]
    target: tuple[float, float, float]
    fovy: float


# The exterior cameras look at the workspace centre (~0.5 m in front of the base). "front" faces the robot
# (DROID's exterior cameras sit on the far side of the table), "side" gives the depth cue the front lacks.
EXTERIOR_CAMERAS = (
    Camera("front", (1.05, 0.0, 0.50), (0.50, 0.0, 0.06), 48.0),
    Camera("side", (0.50, -0.78, 0.48), (0.50, 0.0, 0.06), 52.0),
)


def _xyaxes(pos: tuple[float, ...], target: tuple[float, ...]) -> str:
    """MuJoCo cameras look along their -z: build x (image right) and y (image up) for a look-at camera."""
    fwd = np.asarray(target, float) - np.asarray(pos, float)
    fwd /= np.linalg.norm(fwd)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, fwd)
    return " ".join(f"{v:.5f}" for v in (*right, *up))


def _robot_body() -> tuple[str, str, str, str, str, str]:
    """Split the vendored panda.xml into the sections the scene re-assembles."""
    text = (ASSETS / "panda.xml").read_text()

    def section(tag: str) -> str:
        start, end = text.index(f"<{tag}>") + len(tag) + 2, text.rindex(f"</{tag}>")
        return text[start:end]

    return tuple(section(t) for t in ("default", "asset", "worldbody", "tendon", "equality", "actuator"))


@cache
def mesh_assets() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((ASSETS / "meshes").iterdir())}


def _turntable() -> tuple[str, str]:
    """A disc on a vertical hinge, spun by a stiff velocity servo (actuator 9; its ctrl is the angular speed,
    rad/s). Two dark spokes make its rotation visible in the images."""
    h = TURNTABLE_TOP / 2
    body = (f'<body name="turntable" pos="0.5 0 {h}"><joint name="turntable" type="hinge" axis="0 0 1" '
            f'damping="0.5"/><geom name="turntable" type="cylinder" size="{TURNTABLE_RADIUS} {h}" mass="2" '
            f'rgba="0.78 0.78 0.8 1" friction="1.5 0.01 0.001"/>'
            f'<geom type="box" size="{TURNTABLE_RADIUS * 0.95} 0.006 0.0005" pos="0 0 {h}" rgba="0.3 0.3 0.35 1" '
            f'contype="0" conaffinity="0"/>'
            f'<geom type="box" size="0.006 {TURNTABLE_RADIUS * 0.95} 0.0005" pos="0 0 {h}" rgba="0.3 0.3 0.35 1" '
            f'contype="0" conaffinity="0"/></body>')
    return body, '<velocity name="turntable" joint="turntable" kv="200" ctrlrange="-3 3" forcerange="-50 50"/>'


def scene_xml(n_cubes: int, timestep: float, *, turntable: bool = False) -> str:
    default, asset, robot, tendon, equality, actuator = _robot_body()
    table_body, table_actuator = _turntable() if turntable else ("", "")
    cubes = "\n".join(
        f'<body name="cube{i}" pos="0.5 {0.1 * i} {CUBE_HALF}"><freejoint name="cube{i}"/>'
        f'<geom name="cube{i}" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" mass="0.05" '
        f'friction="1.5 0.01 0.001" rgba="0.8 0.1 0.1 1" condim="4"/></body>'
        for i in range(n_cubes)
    )
    cams = "\n".join(
        f'<camera name="{c.name}" pos="{" ".join(map(str, c.pos))}" xyaxes="{_xyaxes(c.pos, c.target)}" '
        f'fovy="{c.fovy}"/>'
        for c in EXTERIOR_CAMERAS
    )
    return f"""<mujoco model="wamrt_panda_table">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{timestep:.8f}" integrator="implicitfast" cone="elliptic" impratio="10"/>
  <visual>
    <global offwidth="640" offheight="640"/>
    <quality shadowsize="0"/>
    <headlight diffuse="0.55 0.55 0.55" ambient="0.35 0.35 0.35" specular="0 0 0"/>
  </visual>
  <default>{default}</default>
  <asset>{asset}
    <material name="table" rgba="0.62 0.50 0.38 1"/>
    <texture name="sky" type="skybox" builtin="gradient" rgb1="0.55 0.6 0.65" rgb2="0.25 0.28 0.3" width="32"
      height="192"/>
  </asset>
  <worldbody>
    <light name="key" pos="0.6 -0.4 1.6" dir="-0.1 0.25 -1" directional="true" castshadow="false"
      diffuse="0.5 0.5 0.5"/>
    <geom name="table" type="plane" size="1.5 1.5 0.05" material="table"/>
    <geom name="pad" type="box" size="{PAD_HALF} {PAD_HALF} 0.001" pos="0.5 0 0.001" rgba="0.15 0.7 0.2 1"
      contype="0" conaffinity="0"/>
    {cams}
    {robot}
    {table_body}
    {cubes}
  </worldbody>
  <tendon>{tendon}</tendon>
  <equality>{equality}</equality>
  <actuator>{actuator}{table_actuator}</actuator>
</mujoco>"""
