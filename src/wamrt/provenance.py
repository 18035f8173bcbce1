"""Where a result came from: the git commit and the machine, for every committed result file.

Light on purpose (torch is imported only inside `environment`): simulator lanes write result files too.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

_head_at_first_call: str | None = None


def git_sha() -> str:
    """`WAMRT_GIT_SHA` when set (the GPU machine gets a copy of the tree without .git), else HEAD as it was at this
    process's first call: a grid that writes its cells over an hour names the code it started with, not the commits
    made meanwhile (`wamrt.cli.main` calls this at start)."""
    global _head_at_first_call
    if os.environ.get("WAMRT_GIT_SHA"):
        return os.environ["WAMRT_GIT_SHA"]
    if _head_at_first_call is None:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                                 timeout=10, cwd=Path(__file__).parent)
            _head_at_first_call = out.stdout.strip() or "unknown"
        except (OSError, subprocess.TimeoutExpired):
            _head_at_first_call = "unknown"
    return _head_at_first_call


def utc_now(timespec: str = "seconds") -> str:
    """UTC in ISO form; timespec="milliseconds" to find a row's samples in a clock log."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec=timespec)


def environment() -> dict:
    """torch / python / git sha / date / GPU name, count and driver ("cpu" without CUDA)."""
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "git_sha": git_sha(),
           "date": utc_now(), "gpu": "cpu"}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True).split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            pass
    return env
