"""Read a LeRobot v3.0 dataset with the `lerobot` package itself and dump what it returns.

Runs in a separate venv that has `lerobot==0.4.4` (and no wamrt): see
tests/eval/test_export.py::test_lerobot_package_reads_export and
bench/results/rollout/2026-11-30-lerobot-0.4.4-readback.txt for how that venv is built.

    HF_HUB_OFFLINE=1 python tests/eval/lerobot_readback.py DATASET_ROOT OUT.npz

Iterates every frame through `LeRobotDataset.__getitem__` (videos decoded with video_backend="pyav") and
writes OUT.npz with the per-frame columns (observation.state, action, timestamp, frame_index,
episode_index, index, task) and every camera frame as uint8 [N, H, W, 3], plus OUT.json with the package
versions and dataset counts.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
from pathlib import Path


def _declare_torchvision_nms_if_ops_missing() -> bool:
    """PyPI's Linux torchvision wheels are CUDA builds: next to a CPU-only torch their ops library (_C.so)
    cannot load, and `import torchvision` then dies registering a fake kernel for the undeclared op
    `torchvision::nms`. Declaring that one schema lets torchvision import; none of its compiled ops is
    used here (lerobot's pyav path is torchvision.io.VideoReader, pure Python over PyAV). Returns whether
    the workaround was applied."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(next(iter(spec.submodule_search_locations))) / "_C.so"
    import torch

    try:
        ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib))
        return False
    except OSError:
        pass
    global _NMS_LIB  # keep the Library object alive: dropping it would undo the definition
    _NMS_LIB = torch.library.Library("torchvision", "FRAGMENT")
    _NMS_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


def main(root: str, out: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shim = _declare_torchvision_nms_if_ops_missing()
    import av
    import lerobot
    import numpy as np
    import torch
    import torchvision
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("local/wamrt_sim", root=root, video_backend="pyav")
    cams = list(ds.meta.video_keys)
    cols: dict[str, list] = {k: [] for k in ("observation.state", "action", "timestamp", "frame_index",
                                             "episode_index", "index", "task")}
    images: dict[str, list] = {c: [] for c in cams}
    for i in range(len(ds)):
        item = ds[i]
        for k in cols:
            v = item[k]
            cols[k].append(v if isinstance(v, str) else v.numpy())
        for c in cams:
            img = item[c]  # float32 [3, H, W] in [0, 1], as lerobot returns video frames
            images[c].append((img.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8))
    arrays = {k: np.stack(v) if k != "task" else np.array(v) for k, v in cols.items()}
    arrays.update({f"image/{c}": np.stack(v) for c, v in images.items()})
    np.savez(out, **arrays)
    summary = {"python": sys.version.split()[0], "lerobot": lerobot.__version__, "torch": torch.__version__,
               "torchvision": torchvision.__version__, "av": av.__version__, "numpy": np.__version__,
               "torchvision_nms_schema_declared": shim, "len": len(ds), "num_episodes": ds.num_episodes,
               "num_frames": ds.num_frames, "fps": ds.fps, "video_keys": cams,
               "tasks": list(ds.meta.tasks.index), "codebase_version": ds.meta.info["codebase_version"]}
    Path(out).with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
