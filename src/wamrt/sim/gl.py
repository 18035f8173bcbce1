"""Pick a headless OpenGL backend for MuJoCo before `mujoco` is imported.

MuJoCo reads MUJOCO_GL once, at import time, so the choice must happen first. EGL (Mesa's llvmpipe on a
CPU box, the driver's EGL on a GPU box) is fastest; OSMesa is the fallback. Each candidate is probed in a
subprocess because a failed context creation can leave the parent process's GL state unusable.

Debian/Ubuntu packages: EGL needs `libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0`; OSMesa needs `libosmesa6`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

BACKENDS = ("egl", "osmesa")
APT_PACKAGES = ("libegl1", "libegl-mesa0", "libgl1-mesa-dri", "libopengl0", "libosmesa6")
_PROBE = "import mujoco; c = mujoco.GLContext(16, 16); c.make_current(); c.free()"
_chosen: str | None = None


def probe(backend: str, timeout_s: float = 60.0) -> bool:
    """True when a MuJoCo GL context can be created with MUJOCO_GL=backend (in a child process)."""
    env = {**os.environ, "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend}
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE], check=False, env=env, capture_output=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _mujoco_installed() -> bool:
    if "mujoco" in sys.modules:
        return sys.modules["mujoco"] is not None  # None: blocked, as an uninstalled module
    try:
        return importlib.util.find_spec("mujoco") is not None
    except (ImportError, ValueError):
        return False


def configure_gl() -> str:
    """Set MUJOCO_GL (and PYOPENGL_PLATFORM) to a working headless backend and return it.

    An explicit MUJOCO_GL is respected as is. Raises RuntimeError naming the apt packages when nothing works, and
    ImportError when mujoco itself is missing (every probe would fail, and the error would blame OpenGL).
    """
    global _chosen
    if not _mujoco_installed():
        raise ImportError("No module named 'mujoco'", name="mujoco")
    if os.environ.get("MUJOCO_GL"):
        return os.environ["MUJOCO_GL"]
    if _chosen is None:
        if "mujoco" in sys.modules:
            # Too late to choose: mujoco already picked its default (GLFW, which needs a display).
            raise RuntimeError("configure_gl() must run before `import mujoco`; or set MUJOCO_GL=egl|osmesa")
        for backend in BACKENDS:
            if probe(backend):
                _chosen = backend
                break
        else:
            raise RuntimeError(
                "no headless OpenGL for MuJoCo: install " + " ".join(APT_PACKAGES) + " (apt), or set MUJOCO_GL"
            )
    os.environ["MUJOCO_GL"] = _chosen
    os.environ.setdefault("PYOPENGL_PLATFORM", _chosen)
    return _chosen
