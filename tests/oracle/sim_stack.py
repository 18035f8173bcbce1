"""The simulator tests need the `sim` extra (mujoco) and a headless GL (EGL or OSMesa).

Locally a missing piece skips them cleanly; on CI (which installs both, see .ci/run) it is a failure.
Importing wamrt.sim chooses MUJOCO_GL (egl, else osmesa, each probed in a subprocess) before MuJoCo
loads; an explicit MUJOCO_GL in the environment wins.
"""

import os

import pytest


def require_sim_stack() -> None:
    try:
        import wamrt.sim  # noqa: F401
    except (ImportError, RuntimeError) as exc:  # mujoco missing / no GL backend
        if os.environ.get("CI"):
            raise
        pytest.skip(f"wamrt.sim unavailable: {exc}", allow_module_level=True)
