"""Scripted expert: Cartesian waypoints for the TCP, turned into absolute joint targets by DLS IK.

It reads privileged simulator state (cube and pad poses) at every step, so it re-plans when a cube slips,
and it emits exactly the action a policy emits: [7 joint targets, gripper]. The commanded TCP moves toward
the current waypoint at a bounded speed, so the joint targets form a smooth 15 Hz trajectory.
"""

from __future__ import annotations

import numpy as np

from .env import HOME, PandaEnv
from .ik import DlsIk
from .scene import CUBE_HALF

SPEED = 0.02  # m per control step (0.3 m/s) in free space
SLOW = 0.008  # m per control step close to the cube / table
YAW_STEP = 0.12  # rad per control step
HOVER = 0.12  # approach height of the TCP above the cube centre
CARRY_Z = 0.20  # TCP height while carrying
GRASP_STEPS = 7  # control steps with the gripper closing before lifting
RELEASE_STEPS = 6
# Turntable: the gripper aims where the cube will be this far ahead, which covers the servos' lag behind the
# commanded targets (a static cube needs no lead).
LEAD_S = 0.2
# A held cube is lowered onto the pad from this far off the pad's centre (horizontally, at any height), recentring on
# the way down (PLACE_TOL accepts 5 cm). A 1 cm window taught policies to hover: a planner resuming from a policy's arm
# 1-3 cm off rose back to carry height to recentre (bench/results/rollout/2026-12-07-476dde2-dagger-labels-cpu/), and
# the demos, in which the expert's own carry lowered only once within 1 cm, kept a round-7 policy hovering 1.5-2.6 cm
# off at carry height while the labels from those states lowered at once
# (bench/results/rollout/2026-12-07-5d117a2-dagger-round7-grasp-mask-h100/). Now both lower from within 4 cm.
LOWER_RESUME_M = 0.04
# An approach that starts low (TCP more than 3 cm below the hover point) goes over the cube at this height above its
# centre (the fingertips ~3 cm clear of its top) and descends from there, where it rose to the hover point (12 cm)
# and descended at SLOW: those labels, rise up to 12 cm and come back at 0.8 cm a step, made DAgger rounds teach the
# policy to back away from a cube it had nearly reached.
REAPPROACH_Z = 0.06


def _rz(yaw: float) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _cube_yaw(quat: np.ndarray) -> float:
    w, x, y, z = quat
    return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))


class ScriptedExpert:
    """Closed-loop on privileged state. Call `reset(env)` after `env.reset`, then `act(env)` each step."""

    def __init__(self) -> None:
        self.speed_scale = 1.0  # a planner's per-plan variation (eval.planner); 1 = the expert's own speeds
        self.phase = "approach"
        self.counter = 0
        self.ik: DlsIk | None = None
        self.q_cmd = HOME.copy()
        self.p_cmd = np.zeros(3)
        self.yaw_cmd = 0.0
        self.base_rot = np.eye(3)

    def reset(self, env: PandaEnv) -> None:
        m = env.model
        dofadr = np.array([m.jnt_dofadr[m.joint(f"joint{i}").id] for i in range(1, 8)])
        self.ik = DlsIk(m, env.tcp_site, env.arm_qadr, dofadr, rest=HOME)
        self.q_cmd = env.joint_position()
        self.p_cmd, rot = self.ik.forward(self.q_cmd)
        # Grasp orientation: TCP z straight down, keeping the start pose's heading about the vertical.
        z = np.array([0.0, 0.0, -1.0])
        x = rot[:, 0] - rot[:, 0] @ z * z
        x /= np.linalg.norm(x)
        self.base_rot = np.column_stack([x, np.cross(z, x), z])
        self.yaw_cmd = 0.0
        self.phase, self.counter = "approach", 0

    def resume(self, env: PandaEnv) -> None:
        """Pick up mid-episode from simulator state alone, as a planner replanning from an observation must: the
        last commanded action gives the commanded TCP pose, wrist yaw and gripper; the scene gives the phase."""
        self.reset(env)
        _, start_rot = self.ik.forward(env.start_q)  # the episode's start heading, as reset() saw it at step 0
        z = np.array([0.0, 0.0, -1.0])
        x = start_rot[:, 0] - start_rot[:, 0] @ z * z
        x /= np.linalg.norm(x)
        self.base_rot = np.column_stack([x, np.cross(z, x), z])
        self.q_cmd = np.asarray(env.last_action[:7], dtype=np.float64).copy()
        self.p_cmd, rot = self.ik.forward(self.q_cmd)
        x0, x = self.base_rot[:, 0], rot[:, 0]  # yaw_cmd turns the start heading about the world z axis
        self.yaw_cmd = float(np.arctan2(np.cross(x0, x)[2], x0 @ x))
        self.phase, self.counter = self._infer_phase(env), 0

    def _infer_phase(self, env: PandaEnv) -> str:
        assert env.layout is not None
        i = env.layout.target
        cube, tcp = env.cube_pos(i), env.tcp_pos()
        closing = env.last_action[7] > 0.5
        near = np.linalg.norm(cube - tcp) < 0.04
        if closing and near:
            if env.gripper_position() < 0.3:  # the fingers have not closed on the cube yet
                return "grasp"
            if env.spec.uses_pad and np.linalg.norm(tcp[:2] - env.layout.pad_xy) < LOWER_RESUME_M:
                return "lower"
            return "carry" if tcp[2] >= CARRY_Z - 0.005 else "lift"
        if not closing and near and env.success():
            return "release"
        if env.success():
            return "retreat"
        aim, _ = self._cube_pose(env, i)
        if not closing and np.linalg.norm(tcp[:2] - aim[:2]) < 0.03 and tcp[2] < aim[2] + HOVER - 0.01:
            return "descend"
        return "approach"

    def _cube_pose(self, env: PandaEnv, i: int) -> tuple[np.ndarray, float]:
        """Position and yaw of cube i LEAD_S from now: turning about the disc axis while it rides the turntable,
        where it is otherwise."""
        cube, yaw = env.cube_pos(i), _cube_yaw(env.cube_quat(i))
        if env.on_turntable(i):
            assert env.layout is not None and env.layout.turntable_xy is not None
            turn = env.turntable_rate() * LEAD_S
            centre = env.layout.turntable_xy
            cube = np.r_[centre + _rz(turn)[:2, :2] @ (cube[:2] - centre), cube[2]]
            yaw += turn
        return cube, yaw

    def _grasp_yaw(self, env: PandaEnv, cube_yaw: float) -> float:
        # A cube is symmetric under 90 degree turns: pick the equivalent yaw closest to the start heading.
        base = float(np.arctan2(self.base_rot[1, 0], self.base_rot[0, 0]))
        rel = float((cube_yaw - base + np.pi / 4) % (np.pi / 2) - np.pi / 4)
        if env.spec.turntable:
            # A turning cube sweeps through the +-45 degree seam: stay with the equivalent yaw nearest the wrist's
            # current one (within +-135 degrees of the start heading), so the goal does not flip by 90 degrees.
            options = [rel + k * np.pi / 2 for k in (-1, 0, 1) if abs(rel + k * np.pi / 2) <= 0.75 * np.pi]
            rel = min(options, key=lambda y: abs(y - self.yaw_cmd))
        return rel

    def _move(self, target: np.ndarray, speed: float) -> bool:
        delta = target - self.p_cmd
        dist = float(np.linalg.norm(delta))
        self.p_cmd = target.copy() if dist <= speed else self.p_cmd + delta * (speed / dist)
        return dist <= speed

    def act(self, env: PandaEnv) -> np.ndarray:
        assert self.ik is not None and env.layout is not None, "reset(env) first"
        i = env.layout.target
        cube, cube_yaw = self._cube_pose(env, i)
        tcp = env.tcp_pos()
        gripper = 0.0
        yaw_goal = self.yaw_cmd
        ph = self.phase
        if ph == "approach":
            yaw_goal = self._grasp_yaw(env, cube_yaw)
            if tcp[2] > cube[2] + HOVER - 0.03:  # from above (every episode's start): straight to the hover point
                over = waypoint = cube + [0.0, 0.0, HOVER]
            else:
                # Low (after a miss, or a policy's arm the planner took over): over the cube just clear of its top,
                # rising first where the fingers could sweep through it.
                over = cube + [0.0, 0.0, REAPPROACH_Z]
                waypoint = over if tcp[2] > over[2] - 0.01 else np.r_[self.p_cmd[:2], over[2]]
            arrived = self._move(waypoint, SPEED * self.speed_scale)
            aligned = abs(yaw_goal - self.yaw_cmd) < 2 * YAW_STEP  # a short low approach may not have turned yet
            if arrived and waypoint is over and np.linalg.norm(tcp - over) < 0.015 and aligned:
                self.phase = "descend"
        elif ph == "descend":
            yaw_goal = self._grasp_yaw(env, cube_yaw)
            if self._move(cube + [0.0, 0.0, -0.004], SLOW * self.speed_scale) and tcp[2] < cube[2] + 0.008:
                self.phase, self.counter = "grasp", 0
        elif ph == "grasp":
            gripper = 1.0
            if env.spec.turntable:  # keep the fingers around a cube that keeps turning while they close
                yaw_goal = self._grasp_yaw(env, cube_yaw)
                self._move(cube + [0.0, 0.0, -0.004], SLOW)
            self.counter += 1
            if self.counter >= GRASP_STEPS:
                self.phase = "lift"
        elif ph in ("lift", "carry", "lower"):
            gripper = 1.0
            if np.linalg.norm(env.cube_pos(i) - tcp) > 0.04 or env.gripper_position() > 0.97:
                self.phase = "approach"  # dropped or missed: open and try again
                gripper = 0.0
            elif ph == "lift":
                if self._move(np.r_[self.p_cmd[:2], CARRY_Z], SPEED) and env.spec.uses_pad:
                    self.phase = "carry"
            elif ph == "carry":
                pad = env.layout.pad_xy
                self._move(np.r_[pad, CARRY_Z], SPEED)
                if np.linalg.norm(tcp[:2] - pad) < LOWER_RESUME_M:
                    self.phase = "lower"
            elif self._move(np.r_[env.layout.pad_xy, CUBE_HALF + 0.012], SLOW):
                self.phase, self.counter = "release", 0
        elif ph == "release":
            self.counter += 1
            if self.counter >= RELEASE_STEPS:
                self.phase = "retreat"
        elif ph == "retreat":
            self._move(np.r_[self.p_cmd[:2], CARRY_Z], SPEED)
        step = float(np.clip(yaw_goal - self.yaw_cmd, -YAW_STEP, YAW_STEP))
        self.yaw_cmd += step
        rot = _rz(self.yaw_cmd) @ self.base_rot
        self.q_cmd = self.ik.solve(self.q_cmd, self.p_cmd, rot)
        return np.r_[self.q_cmd, gripper].astype(np.float32)
