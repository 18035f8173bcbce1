"""Damped-least-squares inverse kinematics of the TCP site, on a private MjData (never the live one)."""

from __future__ import annotations

import mujoco
import numpy as np

_EYE6, _EYE7 = np.eye(6), np.eye(7)


def rotation_error(current: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Small-angle axis-angle vector taking `current` to `target` (both 3x3 world rotations): half the sum over the
    columns k of current[:, k] x target[:, k].

    Written out because `np.cross` spends most of its time reshaping 3-vectors: a DAgger label (the expert planning
    32 rows, one IK solve a row) took 109 ms on one core with three calls per IK iteration and 77 ms without.
    The same products, differences and left-to-right sums in the same order: bit-identical to the cross-product
    form (tests/sim/test_ik.py), so the expert's demos and labels do not change."""
    c, t = current, target
    x = c[1] * t[2] - c[2] * t[1]  # component 0 of column k's cross product, for k = 0, 1, 2
    y = c[2] * t[0] - c[0] * t[2]
    z = c[0] * t[1] - c[1] * t[0]
    return 0.5 * np.array([x[0] + x[1] + x[2], y[0] + y[1] + y[2], z[0] + z[1] + z[2]])


class DlsIk:
    """q -> q' with TCP at (pos, rot). A null-space pull toward `rest` keeps the elbow out of trouble."""

    def __init__(self, model: mujoco.MjModel, site: int, qadr: np.ndarray, dofadr: np.ndarray,
                 rest: np.ndarray, damping: float = 0.05) -> None:
        self.model, self.site, self.qadr, self.dofadr = model, site, qadr, dofadr
        self.data = mujoco.MjData(model)
        self.rest, self.damping = rest, damping
        self.low = model.jnt_range[[model.dof_jntid[d] for d in dofadr], 0]
        self.high = model.jnt_range[[model.dof_jntid[d] for d in dofadr], 1]
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = self.data
        d.qpos[self.qadr] = q
        mujoco.mj_kinematics(self.model, d)
        return d.site_xpos[self.site].copy(), d.site_xmat[self.site].reshape(3, 3).copy()

    def solve(self, q: np.ndarray, pos: np.ndarray, rot: np.ndarray, iters: int = 15, tol: float = 2e-4,
              rot_weight: float = 0.5, null_gain: float = 0.05) -> np.ndarray:
        q = q.astype(np.float64).copy()
        w = np.array([1.0, 1.0, 1.0, rot_weight, rot_weight, rot_weight])
        for _ in range(iters):
            cur_p, cur_r = self.forward(q)
            err = np.concatenate([pos - cur_p, rotation_error(cur_r, rot)]) * w
            if np.linalg.norm(err) < tol:
                break
            mujoco.mj_comPos(self.model, self.data)  # mj_jacSite needs the com-based quantities
            mujoco.mj_jacSite(self.model, self.data, self._jacp, self._jacr, self.site)
            jac = np.vstack([self._jacp[:, self.dofadr], self._jacr[:, self.dofadr]]) * w[:, None]  # [6, 7]
            jjt = jac @ jac.T + self.damping**2 * _EYE6
            pinv = jac.T @ np.linalg.solve(jjt, _EYE6)  # [7, 6]
            dq = pinv @ err + (_EYE7 - pinv @ jac) @ (null_gain * (self.rest - q))
            q = np.clip(q + dq, self.low, self.high)
        return q
