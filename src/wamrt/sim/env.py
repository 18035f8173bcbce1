"""`PandaEnv`: a Panda on a table at 15 Hz, driven by 7 absolute joint targets + 1 gripper (DROID's action).

Action row: [q1..q7 (radians, absolute joint targets), gripper (0 = open, 1 = closed)], the Cosmos DROID
convention. Each control step holds the targets for 1/15 s of physics (the Menagerie joint servos plus
gravity compensation track them). Observations carry the raw camera images, the measured joint positions
and the gripper closure in [0, 1].
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from .gl import configure_gl

configure_gl()  # MUJOCO_GL must be set before mujoco is imported
import mujoco

from .scene import CUBE_HALF, TURNTABLE_RADIUS, TURNTABLE_TOP, mesh_assets, scene_xml
from .tasks import COLOURS, TASKS, Layout, TaskSpec, cube_lifted, cube_on_pad, sample_layout

CONTROL_HZ = 15
SUBSTEPS = 34  # physics dt = 1/(15*34) ~ 1.96 ms, close to MuJoCo's 2 ms default, and exact 15 Hz control
# Start pose: the TCP ~0.45 m in front of the base, 0.35 m above the table, pointing down.
HOME = np.array([0.0, -0.35, 0.0, -2.3, 0.0, 1.95, 0.785])
FINGER_OPEN = 0.04  # metres per finger
ARM_JOINTS = tuple(f"joint{i}" for i in range(1, 8))


@dataclass
class Observation:
    images: dict[str, np.ndarray]  # camera name -> uint8 [H, W, 3]
    joint_position: np.ndarray  # [7] float64, measured
    gripper_position: float  # 0 open .. 1 closed, measured
    prompt: str
    step: int


class JointNoise:
    """Ornstein-Uhlenbeck noise on the 7 executed joint targets: the arm is pushed off the commanded path by a
    smooth excursion the PD servos follow, not jitter they filter out. `sigma` is the stationary std (rad),
    `theta` the per-step pull to zero (~1/theta steps of correlation). Used for DART demos (`record.py`, where
    the recorded action stays the expert's own) and as the env's actuation noise; `stream` keeps the two
    random streams of one seed apart."""

    def __init__(self, sigma: float, seed: int, theta: float = 0.15, stream: int = 0xDA27) -> None:
        if not (sigma >= 0 and np.isfinite(sigma)):
            raise ValueError(f"action noise sigma must be a finite number >= 0, got {sigma}")
        self.sigma, self.theta = float(sigma), float(theta)
        self.rng = np.random.default_rng([int(seed), stream])
        self.x = self.rng.normal(0.0, self.sigma, 7) if sigma > 0 else np.zeros(7)

    def __call__(self, action: np.ndarray) -> np.ndarray:
        if self.sigma == 0:
            return action
        kick = self.sigma * np.sqrt(1.0 - (1.0 - self.theta) ** 2)
        self.x = (1.0 - self.theta) * self.x + self.rng.normal(0.0, kick, 7)
        out = action.copy()
        out[:7] += self.x.astype(out.dtype)
        return out


ACTUATION_NOISE_STREAM = 0xAC7  # JointNoise stream of the env's actuation noise (DART demos use their own)
# Protective stop (PandaEnv(reflexes=True)): a commanded joint target that jumps from the previous one by more than
# twice what the Panda's joint speed limits (2.175 rad/s joints 1-4, 2.61 rad/s joints 5-7) allow in one 15 Hz step
# halts the arm, as a real controller's discontinuity reflex does: it holds where it is and ignores commands for the
# rest of the episode (on a real robot, until a person clears the error), so the episode fails. The scripted expert
# peaks at 0.13 / 0.19 rad a step (joints 1-4 / 5-7, turntable, 20 seeds), under the 0.29 / 0.35 thresholds; a client
# that skips rows of a fast motion (a chunk switched in at its row d > 1 while the arm stood still) trips it.
REFLEX_STEP = 2.0 * np.array([2.175] * 4 + [2.61] * 3) / CONTROL_HZ


@dataclass
class StepTimes:
    physics_ms: list[float] = field(default_factory=list)
    render_ms: list[float] = field(default_factory=list)


class PandaEnv:
    """One simulator instance. Not thread-safe; make one per lane (each owns its GL context)."""

    def __init__(
        self,
        task: str | TaskSpec,
        *,
        exterior_hw: tuple[int, int] = (128, 224),
        wrist_hw: tuple[int, int] | None = None,
        cameras: tuple[str, ...] = ("front", "side", "wrist"),
        render: bool = True,
        actuation_noise: float = 0.0,
        reflexes: bool | None = None,
    ) -> None:
        """actuation_noise: std (rad) of seeded Ornstein-Uhlenbeck noise added to every executed joint target
        (`JointNoise`, re-seeded from the episode seed at reset): a robot that does not land exactly where it
        was told. reflexes: protective stops on commanded jumps (REFLEX_STEP; default: the task's)."""
        self.spec = TASKS[task] if isinstance(task, str) else task
        self.reflexes = self.spec.reflexes if reflexes is None else bool(reflexes)
        self.model = mujoco.MjModel.from_xml_string(
            scene_xml(self.spec.n_cubes, 1.0 / (CONTROL_HZ * SUBSTEPS), turntable=self.spec.turntable), mesh_assets()
        )
        self.data = mujoco.MjData(self.model)
        m = self.model
        self.arm_qadr = np.array([m.jnt_qposadr[m.joint(j).id] for j in ARM_JOINTS])
        self.finger_qadr = np.array([m.jnt_qposadr[m.joint(f"finger_joint{i}").id] for i in (1, 2)])
        self.cube_qadr = [m.jnt_qposadr[m.joint(f"cube{i}").id] for i in range(self.spec.n_cubes)]
        self.cube_geom = [m.geom(f"cube{i}").id for i in range(self.spec.n_cubes)]
        self.pad_geom = m.geom("pad").id
        hand_bodies = {m.body(b).id for b in ("hand", "left_finger", "right_finger")}
        self.gripper_geoms = {g for g in range(m.ngeom) if m.geom_bodyid[g] in hand_bodies}
        self.tcp_site = m.site("tcp").id
        self.cube_dofadr = [m.jnt_dofadr[m.joint(f"cube{i}").id] for i in range(self.spec.n_cubes)]
        self.turntable_body = m.body("turntable").id if self.spec.turntable else None
        self.turntable_dof = m.jnt_dofadr[m.joint("turntable").id] if self.spec.turntable else None
        self.actuation_noise = float(actuation_noise)
        self._noise = JointNoise(self.actuation_noise, 0, stream=ACTUATION_NOISE_STREAM)
        self.ctrl_low, self.ctrl_high = m.actuator_ctrlrange[:7, 0].copy(), m.actuator_ctrlrange[:7, 1].copy()
        # A wrist view twice the exterior size survives compose_droid_canvas (which halves the exteriors).
        self.camera_hw = {c: (wrist_hw or (2 * exterior_hw[0], 2 * exterior_hw[1])) if c == "wrist"
                          else exterior_hw for c in cameras}
        self.render_enabled = render
        self._renderers: dict[tuple[int, int], mujoco.Renderer] = {}
        self.layout: Layout | None = None
        self.start_q = HOME.copy()
        self.last_action = np.r_[HOME, 0.0]
        self.halted = False  # a protective stop happened (reflexes): the arm holds, the episode is lost
        self.step_count = 0
        self.times = StepTimes()

    # ---- episode control -------------------------------------------------------------------------
    def reset(self, seed: int, *, render: bool = True) -> Observation:
        lay = sample_layout(self.spec, seed)
        self.layout = lay
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        q0 = np.clip(HOME + lay.joint_noise, self.ctrl_low, self.ctrl_high)
        self.start_q = q0.copy()
        self.last_action = np.r_[q0, 0.0]  # what the robot last executed as told (before any actuation noise)
        self.halted = False  # a protective stop happened (reflexes): the arm holds, the episode is lost
        d.qpos[self.arm_qadr] = q0
        d.qpos[self.finger_qadr] = FINGER_OPEN
        d.ctrl[:7] = q0
        d.ctrl[7] = 255.0
        for i, adr in enumerate(self.cube_qadr):
            x, y = lay.cube_xy[i]
            yaw = lay.cube_yaw[i]
            d.qpos[adr : adr + 7] = [x, y, CUBE_HALF, np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2)]
            m.geom_rgba[self.cube_geom[i], :3] = COLOURS[lay.colours[i]]
        m.geom_pos[self.pad_geom, :2] = lay.pad_xy
        if self.spec.turntable:
            self._spin_up(lay)
        self._noise = JointNoise(self.actuation_noise, seed, stream=ACTUATION_NOISE_STREAM)
        mujoco.mj_forward(m, d)
        self.step_count = 0
        self.times = StepTimes()
        return self.observe(render)

    def _reflex(self, a: np.ndarray) -> np.ndarray:
        """The protective stop (REFLEX_STEP): returns what the arm executes this step."""
        if not self.halted and np.any(np.abs(a[:7] - self.last_action[:7]) > REFLEX_STEP):
            self.halted = True
            self._held = np.r_[self.joint_position(), self.last_action[7]]
        return self._held.copy() if self.halted else a

    def _spin_up(self, lay: Layout) -> None:
        """Disc at the layout's centre, already turning, the cube resting on it and moving with it (no slip)."""
        assert lay.turntable_xy is not None and self.turntable_dof is not None
        self.model.body_pos[self.turntable_body, :2] = lay.turntable_xy
        for adr in self.cube_qadr:
            self.data.qpos[adr + 2] = TURNTABLE_TOP + CUBE_HALF
        self._turn(lay.turntable_speed, range(len(self.cube_qadr)), lay.turntable_xy)

    def set_turntable_rate(self, w: float) -> None:
        """From now on the disc turns at `w` rad/s and every cube resting on it moves with it: a planner's what-if
        (eval/planner.py), never an episode's own dynamics."""
        if self.turntable_dof is None or self.layout is None or self.layout.turntable_xy is None:
            raise ValueError(f"task {self.spec.name!r} has no turntable")
        on_disc = [i for i in range(len(self.cube_qadr)) if self.on_turntable(i)]
        self._turn(w, on_disc, self.layout.turntable_xy)

    def _turn(self, w: float, cubes: Iterable[int], centre: np.ndarray) -> None:
        """The disc at `w` rad/s, and `cubes` (resting on it) moving with it."""
        d = self.data
        d.qvel[self.turntable_dof] = w
        d.ctrl[8] = w
        for i in cubes:
            adr, dof = self.cube_qadr[i], self.cube_dofadr[i]
            r = d.qpos[adr : adr + 2] - centre
            d.qvel[dof : dof + 2] = w * np.array([-r[1], r[0]])
            d.qvel[dof + 5] = w  # free-joint angular velocity (body frame; the cube sits flat, so z is z)

    def step(self, action: np.ndarray, *, render: bool = True) -> Observation:
        """Apply one [8] action row for 1/15 s and return the next observation.

        render=False skips the cameras (images = {}): open-loop chunk rows and the expert need no pixels,
        and rendering costs ~10x the physics on a CPU."""
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (8,) or not np.isfinite(a).all():
            raise ValueError(f"action must be 8 finite numbers, got {a.shape}")
        d = self.data
        if self.reflexes:
            a = self._reflex(a)
        self.last_action = a.copy()
        a = self._noise(a)
        d.ctrl[:7] = np.clip(a[:7], self.ctrl_low, self.ctrl_high)
        d.ctrl[7] = 255.0 * (1.0 - float(np.clip(a[7], 0.0, 1.0)))  # actuator8: 255 = open, 0 = closed
        t0 = time.perf_counter()
        mujoco.mj_step(self.model, d, nstep=SUBSTEPS)
        self.times.physics_ms.append((time.perf_counter() - t0) * 1e3)
        self.step_count += 1
        return self.observe(render)

    # ---- state -----------------------------------------------------------------------------------
    def joint_position(self) -> np.ndarray:
        return self.data.qpos[self.arm_qadr].copy()

    def gripper_position(self) -> float:
        opening = float(self.data.qpos[self.finger_qadr].sum()) / (2 * FINGER_OPEN)
        return float(np.clip(1.0 - opening, 0.0, 1.0))

    def cube_pos(self, i: int) -> np.ndarray:
        adr = self.cube_qadr[i]
        return self.data.qpos[adr : adr + 3].copy()

    def cube_quat(self, i: int) -> np.ndarray:
        adr = self.cube_qadr[i]
        return self.data.qpos[adr + 3 : adr + 7].copy()

    def cube_vel(self, i: int) -> np.ndarray:
        """World-frame linear velocity of cube i (m/s)."""
        dof = self.cube_dofadr[i]
        return self.data.qvel[dof : dof + 3].copy()

    def turntable_rate(self) -> float:
        """Measured angular speed of the disc (rad/s); 0 without one."""
        return float(self.data.qvel[self.turntable_dof]) if self.turntable_dof is not None else 0.0

    def on_turntable(self, i: int) -> bool:
        """Cube i rests on the disc (so it turns with it)."""
        if self.layout is None or self.layout.turntable_xy is None:
            return False
        p = self.cube_pos(i)
        return bool(p[2] < TURNTABLE_TOP + CUBE_HALF + 0.005
                    and np.linalg.norm(p[:2] - self.layout.turntable_xy) < TURNTABLE_RADIUS)

    def tcp_pos(self) -> np.ndarray:
        return self.data.site_xpos[self.tcp_site].copy()

    def touches_gripper(self, i: int) -> bool:
        g = self.cube_geom[i]
        for c in self.data.contact[: self.data.ncon]:
            if (c.geom1 == g and c.geom2 in self.gripper_geoms) or (c.geom2 == g and c.geom1 in self.gripper_geoms):
                return True
        return False

    def cube_held(self, i: int) -> bool:
        """Cube i is in the gripper and off its support: touching the fingers, more than 1 cm above the disc's top
        (and so above the table)."""
        return self.touches_gripper(i) and bool(self.cube_pos(i)[2] > TURNTABLE_TOP + CUBE_HALF + 0.01)

    def success(self) -> bool:
        """The task predicate on simulator state (never on images)."""
        assert self.layout is not None, "reset() first"
        i = self.layout.target
        if self.spec.name == "lift":
            return cube_lifted(self.cube_pos(i))
        return cube_on_pad(self.cube_pos(i), self.layout.pad_xy, self.touches_gripper(i))

    def state(self) -> dict[str, Any]:
        """Privileged state (for the expert and for logs; a policy never sees it)."""
        assert self.layout is not None
        n = self.spec.n_cubes
        return {"cube_pos": np.stack([self.cube_pos(i) for i in range(n)]),
                "cube_quat": np.stack([self.cube_quat(i) for i in range(n)]),
                "pad_xy": self.layout.pad_xy.copy(), "target": self.layout.target, "tcp_pos": self.tcp_pos()}

    # ---- rendering -------------------------------------------------------------------------------
    def render(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if not self.render_enabled:
            return out
        t0 = time.perf_counter()
        for cam, hw in self.camera_hw.items():
            r = self._renderers.get(hw)
            if r is None:
                r = self._renderers[hw] = mujoco.Renderer(self.model, hw[0], hw[1])
            r.update_scene(self.data, camera=cam)
            out[cam] = r.render()  # a fresh uint8 [H, W, 3] array per call
        self.times.render_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def observe(self, render: bool = True) -> Observation:
        assert self.layout is not None
        images = self.render() if render else {}
        return Observation(images, self.joint_position(), self.gripper_position(),
                           self.layout.instruction, self.step_count)

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
