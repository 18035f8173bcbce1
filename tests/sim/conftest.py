"""The simulator tests need the `sim` extra (mujoco) and a headless GL (EGL or OSMesa); skip cleanly without.

Importing wamrt.sim chooses MUJOCO_GL (egl, else osmesa, each probed in a subprocess) before MuJoCo loads;
an explicit MUJOCO_GL in the environment wins.
"""

import os

import pytest

# CI installs the sim extra and the GL packages (.ci/run): there a missing piece is a failure, not a skip.
_on_ci = bool(os.environ.get("CI"))
try:
    import wamrt.sim  # noqa: F401
except (ImportError, RuntimeError) as exc:  # mujoco missing / no GL backend
    if _on_ci:
        raise
    pytest.skip(f"wamrt.sim unavailable: {exc}", allow_module_level=True)
