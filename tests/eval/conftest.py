"""The simulator tests need the `sim` extra (mujoco) and a headless GL (EGL or OSMesa); skip cleanly without.

Importing wamrt.sim chooses MUJOCO_GL (egl, else osmesa, each probed in a subprocess) before MuJoCo loads;
an explicit MUJOCO_GL in the environment wins.
"""

import pytest

try:
    import wamrt.sim  # noqa: F401
except ImportError as exc:  # mujoco missing
    pytest.skip(f"wamrt.sim unavailable: {exc}", allow_module_level=True)
except RuntimeError as exc:  # no GL backend
    pytest.skip(str(exc), allow_module_level=True)
