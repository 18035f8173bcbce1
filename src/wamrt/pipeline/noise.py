"""Initial noise and the DROID state row, bit-exact with the framework server.

The server draws Gaussian noise with numpy's legacy generator, a fresh `RandomState(seed)` per
modality, so the action noise equals the first 33*64 values of the vision noise. diffusers instead
draws both from one torch generator; that path is not reproduced here.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from wamrt.pipeline.errors import RequestError

JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
DROID_NUM_JOINTS = 7
DROID_RAW_ACTION_DIM = 8  # joint_pos action space: 7 joints + gripper
DROID_ACTION_ROWS = 33  # clean state row + 32 predicted rows
MAX_ACTION_DIM = 64  # the transformer's padded action width


@dataclass(frozen=True)
class ActionInit:
    x0: np.ndarray  # [rows, max_dim] float32: row 0 = state, everything else 0 (the clean tensor)
    noise: np.ndarray  # [rows, max_dim] float32: the raw legacy-Gaussian draw
    init: np.ndarray  # [rows, max_dim] float32: row 0 = state, rows 1.. = noise in cols < raw_dim, else 0


def _check_seed(seed: Any) -> int:
    # RandomState accepts 0 <= seed < 2**32; anything else would silently mean a different stream.
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**32:
        raise RequestError(f"must be an integer in [0, 2**32), got {seed!r}", field="seed")
    return int(seed)


def legacy_gaussian(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """`RandomState(seed).standard_normal(shape)` (float64 draw) cast to float32."""
    return np.random.RandomState(_check_seed(seed)).standard_normal(tuple(shape)).astype(np.float32)


def vision_noise(seed: int, latent_shape: tuple[int, ...]) -> np.ndarray:
    """Noise for the whole vision latent, e.g. [1, 48, 9, 33, 40]; frame 0 is later overwritten."""
    return legacy_gaussian(seed, latent_shape)


def _finite_float32(value: Any, field: str) -> np.ndarray:
    if value is None:
        raise RequestError("is missing", field=field)
    try:
        array = np.asarray(value, dtype=np.float32)  # float64 input rounds to nearest, as on the server
    except (TypeError, ValueError) as exc:
        raise RequestError(f"is not numeric ({exc})", field=field) from exc
    if not np.isfinite(array).all():
        raise RequestError("contains NaN or inf", field=field)
    return array


def droid_state_row(joint_position: Any, gripper_position: Any) -> np.ndarray:
    """[q1..q7 of the last joint row, 1 - last gripper value] as float32 [8]; no normalisation."""
    joints = _finite_float32(joint_position, JOINT_KEY)
    if joints.ndim == 1:
        joints = joints[None, :]  # [1, 7]
    if joints.ndim != 2 or joints.shape[0] < 1 or joints.shape[1] != DROID_NUM_JOINTS:
        raise RequestError(
            f"must have shape [7] or [T, 7], got {tuple(np.shape(joint_position))}", field=JOINT_KEY
        )

    gripper = _finite_float32(gripper_position, GRIPPER_KEY)
    if gripper.ndim == 0:
        gripper = gripper.reshape(1, 1)
    elif gripper.ndim == 1:
        gripper = gripper[:, None]  # [T, 1]
    if gripper.ndim != 2 or gripper.shape[0] < 1 or gripper.shape[1] != 1:
        raise RequestError(
            f"must be a scalar, [T] or [T, 1], got {tuple(np.shape(gripper_position))}", field=GRIPPER_KEY
        )
    # The flip happens in float32 (python 1.0 - float32 array stays float32), matching the server.
    flipped = 1.0 - gripper  # [T, 1]
    return np.concatenate([joints[-1], flipped[-1]]).astype(np.float32)  # [8]


def state_row_from_observation(obs: Mapping[str, Any]) -> np.ndarray:
    """`droid_state_row` reading the openpi observation keys; a missing key is a RequestError."""
    for key in (JOINT_KEY, GRIPPER_KEY):
        if key not in obs:
            raise RequestError("is missing", field=key)
    return droid_state_row(obs[JOINT_KEY], obs[GRIPPER_KEY])


def initial_action(
    state_row: np.ndarray, seed: int, *, rows: int = DROID_ACTION_ROWS, max_action_dim: int = MAX_ACTION_DIM,
    stream: np.ndarray | None = None,
) -> ActionInit:
    """Clean action tensor and the sampler's initial action state for one request.

    `stream`: an already drawn `legacy_gaussian(seed, ...)` of at least rows*max_action_dim values. The
    action draw is a fresh stream of the same seed, i.e. exactly that stream's prefix, so it can be
    reused instead of drawn again."""
    state = np.asarray(state_row, dtype=np.float32)
    if state.ndim != 1 or not 1 <= state.shape[0] <= max_action_dim:
        raise RequestError(
            f"must be a vector of at most {max_action_dim} values, got {state.shape}", field="state"
        )
    if not np.isfinite(state).all():
        raise RequestError("contains NaN or inf", field="state")
    raw_dim = state.shape[0]
    n = rows * max_action_dim
    if stream is not None and stream.size >= n:
        noise = np.ascontiguousarray(stream.reshape(-1)[:n]).reshape(rows, max_action_dim)
    else:
        noise = legacy_gaussian(seed, (rows, max_action_dim))  # [rows, max_dim]
    x0 = np.zeros((rows, max_action_dim), dtype=np.float32)
    x0[0, :raw_dim] = state
    init = x0.copy()
    init[1:, :raw_dim] = noise[1:, :raw_dim]  # padded columns stay 0: they are masked everywhere
    return ActionInit(x0=x0, noise=noise, init=init)


class GaussianPrefetcher:
    """Legacy Gaussian streams drawn ahead of time on a background thread.

    The exact noise of a request is a long sequential numpy draw (~10 ms for a DROID request). When the
    next seed is known in advance (the server's default seed sequence), drawing it while the current
    request runs on the GPU takes it off the critical path.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wamrt-noise")
        self._pending: dict[tuple[int, tuple[int, ...]], Any] = {}

    def prefetch(self, seed: int, shape: tuple[int, ...]) -> None:
        key = (int(seed), tuple(shape))
        if key not in self._pending:
            self._pending[key] = self._pool.submit(legacy_gaussian, seed, shape)

    def get(self, seed: int, shape: tuple[int, ...]) -> np.ndarray:
        future = self._pending.pop((int(seed), tuple(shape)), None)
        return future.result() if future is not None else legacy_gaussian(seed, shape)
