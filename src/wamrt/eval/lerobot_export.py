"""Export recorded episodes (wamrt.sim.record layout) as a LeRobot dataset v3.0, with pyarrow + PyAV only.

Layout written (as lerobot 0.4.4's LeRobotDataset writes it; see the docs/sim.md section on validation):
  meta/info.json                                   codebase_version "v3.0", features, paths, totals
  meta/stats.json                                  per-feature min/max/mean/std/count/q01..q99
  meta/tasks.parquet                               index = task string, column task_index
  meta/episodes/chunk-000/file-000.parquet         one row per episode (ranges, video timestamps, stats/*)
  data/chunk-000/file-000.parquet                  one row per frame
  videos/{key}/chunk-000/file-000.mp4              all episodes of one camera, back to back
Everything fits one file per kind (datasets here are far below lerobot's 100 MB / 200 MB file limits).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..sim.record import load_episode

CODEBASE_VERSION = "v3.0"
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
JOINT_NAMES = [f"joint_{i}" for i in range(1, 8)]
STATE_NAMES = [*JOINT_NAMES, "gripper"]
FILE = "chunk-000/file-000"


def _stats(x: np.ndarray, axis: int | tuple[int, ...], keepdims: bool = False) -> dict[str, np.ndarray]:
    x = x.astype(np.float64)
    out = {"min": x.min(axis=axis, keepdims=keepdims), "max": x.max(axis=axis, keepdims=keepdims),
           "mean": x.mean(axis=axis, keepdims=keepdims), "std": x.std(axis=axis, keepdims=keepdims)}
    for q in QUANTILES:
        out[f"q{int(q * 100):02d}"] = np.quantile(x, q, axis=axis, keepdims=keepdims)
    return out


def _numeric_stats(x: np.ndarray) -> dict[str, Any]:
    s = {k: v.tolist() for k, v in _stats(x, 0).items()}
    s["count"] = [len(x)]
    return s


def _image_stats(frames: np.ndarray) -> dict[str, Any]:
    """Per-channel stats in [0, 1] with shape [3, 1, 1], lerobot's convention for image/video features."""
    # Subsampled in time and space like lerobot's own sample_images (it downsizes to ~150 px): quantiles over
    # every pixel would cost seconds per episode.
    sh, sw = max(1, frames.shape[1] // 64), max(1, frames.shape[2] // 64)
    x = frames[:: max(1, len(frames) // 100), ::sh, ::sw].astype(np.float32) / 255.0  # [t, h, w, 3]
    x = x.transpose(0, 3, 1, 2)  # [t, 3, H, W]
    s = {k: np.squeeze(v, 0).tolist() for k, v in _stats(x, (0, 2, 3), keepdims=True).items()}
    s["count"] = [len(x)]
    return s


def _encode_video(frames: np.ndarray, path: Path, fps: int, codec: str) -> dict[str, Any]:
    import av  # imported lazily: only the exporter needs PyAV

    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames.shape[1:3]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if codec in ("libx264", "h264"):
            stream.options = {"crf": "18", "g": "2"}  # near-lossless, short GOP: cheap random access
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with av.open(str(path)) as f:
        vs = f.streams.video[0]
        canonical = vs.codec_context.codec.canonical_name if hasattr(vs.codec_context, "codec") else codec
    return {"video.height": h, "video.width": w, "video.codec": canonical, "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}


def export_lerobot(episode_files: Sequence[str | Path], root: str | Path, *, robot_type: str = "panda",
                   codec: str = "libx264") -> Path:
    """Write a LeRobot v3.0 dataset at `root` from recorded .npz episodes; returns root."""
    root = Path(root)
    if (root / "meta" / "info.json").exists():
        raise FileExistsError(f"{root} already holds a dataset")
    episodes = [load_episode(p) for p in episode_files]
    if not episodes:
        raise ValueError("no episodes to export")
    fps = int(episodes[0][1]["fps"])
    cameras = list(episodes[0][1]["cameras"])
    tasks: dict[str, int] = {}
    rows: list[pd.DataFrame] = []
    ep_rows: list[dict[str, Any]] = []
    video_frames: dict[str, list[np.ndarray]] = {c: [] for c in cameras}
    start = 0
    for ep_index, (arr, meta) in enumerate(episodes):
        t = len(arr["actions"])
        task_index = tasks.setdefault(meta["prompt"], len(tasks))
        state = np.concatenate([arr["joint_position"], arr["gripper_position"][:, None]], axis=1).astype(np.float32)
        action = arr["actions"].astype(np.float32)
        rows.append(pd.DataFrame({
            "observation.state": list(state), "action": list(action),
            "timestamp": (np.arange(t) / fps).astype(np.float32), "frame_index": np.arange(t, dtype=np.int64),
            "episode_index": np.full(t, ep_index, dtype=np.int64), "index": np.arange(start, start + t, dtype=np.int64),
            "task_index": np.full(t, task_index, dtype=np.int64)}))
        row: dict[str, Any] = {"episode_index": ep_index, "tasks": [meta["prompt"]], "length": t,
                               "data/chunk_index": 0, "data/file_index": 0,
                               "dataset_from_index": start, "dataset_to_index": start + t}
        for cam in cameras:
            frames = arr[f"image_{cam}"]
            key = f"observation.images.{cam}"
            offset = sum(len(f) for f in video_frames[cam]) / fps
            video_frames[cam].append(frames)
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                        f"videos/{key}/from_timestamp": offset, f"videos/{key}/to_timestamp": offset + t / fps})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        ep_stats = {"observation.state": _numeric_stats(state), "action": _numeric_stats(action)}
        for name, col in (("timestamp", np.arange(t) / fps), ("frame_index", np.arange(t)),
                          ("episode_index", np.full(t, ep_index)), ("index", np.arange(start, start + t)),
                          ("task_index", np.full(t, task_index))):
            ep_stats[name] = _numeric_stats(col[:, None].astype(np.float64))
        for cam in cameras:
            ep_stats[f"observation.images.{cam}"] = _image_stats(arr[f"image_{cam}"])
        for feat, st in ep_stats.items():
            for k, v in st.items():
                row[f"stats/{feat}/{k}"] = v
        ep_rows.append(row)
        start += t

    features: dict[str, Any] = {}
    for cam in cameras:
        frames = np.concatenate(video_frames[cam])
        info = _encode_video(frames, root / "videos" / f"observation.images.{cam}" / f"{FILE}.mp4", fps, codec)
        features[f"observation.images.{cam}"] = {"dtype": "video", "shape": list(frames.shape[1:]),
                                                  "names": ["height", "width", "channels"], "info": info}
    features["observation.state"] = {"dtype": "float32", "shape": [8], "names": STATE_NAMES}
    features["action"] = {"dtype": "float32", "shape": [8], "names": STATE_NAMES}
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("task_index", "int64")):
        features[name] = {"dtype": dtype, "shape": [1], "names": None}

    data = pd.concat(rows, ignore_index=True)
    schema = pa.schema([("observation.state", pa.list_(pa.float32(), 8)), ("action", pa.list_(pa.float32(), 8)),
                        ("timestamp", pa.float32()), ("frame_index", pa.int64()), ("episode_index", pa.int64()),
                        ("index", pa.int64()), ("task_index", pa.int64())])
    table = pa.Table.from_pandas(data, schema=schema, preserve_index=False)
    (root / "data" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "data" / f"{FILE}.parquet", compression="snappy")

    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(ep_rows), root / "meta" / "episodes" / f"{FILE}.parquet")
    pd.DataFrame({"task_index": list(tasks.values())}, index=list(tasks)).to_parquet(root / "meta" / "tasks.parquet")

    all_state = np.stack(data["observation.state"].to_numpy())
    all_action = np.stack(data["action"].to_numpy())
    stats: dict[str, Any] = {"observation.state": _numeric_stats(all_state), "action": _numeric_stats(all_action)}
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        stats[name] = _numeric_stats(data[name].to_numpy()[:, None].astype(np.float64))
    for cam in cameras:
        stats[f"observation.images.{cam}"] = _image_stats(np.concatenate(video_frames[cam]))
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": len(episodes),
            "total_frames": start, "total_tasks": len(tasks), "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200, "fps": fps, "splits": {"train": f"0:{len(episodes)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            "features": features}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))
    return root
