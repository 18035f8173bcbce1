"""Built-in Panda simulator: tasks, cameras, a scripted expert, DROID-style observations.

Importing this package selects a headless GL backend (MUJOCO_GL) before MuJoCo loads; see `gl.py`.
"""

from .gl import configure_gl

configure_gl()

from .env import CONTROL_HZ, Observation, PandaEnv
from .expert import ScriptedExpert
from .tasks import TASKS, TaskSpec

__all__ = ["CONTROL_HZ", "TASKS", "Observation", "PandaEnv", "ScriptedExpert", "TaskSpec", "configure_gl"]
