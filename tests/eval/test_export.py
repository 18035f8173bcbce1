import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from wamrt.eval.lerobot_export import export_lerobot
from wamrt.sim.record import load_episode, record_demos


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demos")
    metas = record_demos("lift", [0], out, env_kwargs={"exterior_hw": (64, 96)})
    assert len(metas) == 1 and metas[0].success
    return out


def test_recorded_episode_layout(demos):
    arrays, meta = load_episode(demos / "episode_000000.npz")
    t = meta["length"]
    assert arrays["actions"].shape == (t, 8) and arrays["joint_position"].shape == (t, 7)
    assert arrays["image_wrist"].shape == (t, 128, 192, 3) and arrays["image_front"].dtype == np.uint8
    assert json.loads((demos / "manifest.json").read_text())[0]["prompt"] == meta["prompt"]


def test_lerobot_v3_export(demos, tmp_path):
    av = pytest.importorskip("av")
    root = export_lerobot(sorted(demos.glob("episode_*.npz")), tmp_path / "ds")
    info = json.loads((root / "meta/info.json").read_text())
    arrays, meta = load_episode(demos / "episode_000000.npz")
    t = meta["length"]
    assert info["codebase_version"] == "v3.0" and info["total_frames"] == t and info["total_episodes"] == 1
    data = pq.read_table(root / "data/chunk-000/file-000.parquet").to_pandas()
    state = np.stack(data["observation.state"].to_numpy())
    np.testing.assert_array_equal(state[:, :7], arrays["joint_position"])  # exact round trip
    np.testing.assert_array_equal(np.stack(data["action"].to_numpy()), arrays["actions"])
    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert eps[0]["length"] == t and eps[0]["dataset_to_index"] == t and eps[0]["tasks"] == [meta["prompt"]]
    tasks = pq.read_table(root / "meta/tasks.parquet").to_pandas()
    assert list(tasks.index) == [meta["prompt"]]
    with av.open(str(root / "videos/observation.images.front/chunk-000/file-000.mp4")) as f:
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert len(frames) == t and np.abs(frames[0].astype(int) - arrays["image_front"][0]).mean() < 3


@pytest.mark.slow
def test_lerobot_package_reads_export(demos, tmp_path):
    """Needs lerobot==0.4.4 (a separate ~8 GB venv); run with -m slow there."""
    lerobot_dataset = pytest.importorskip("lerobot.datasets.lerobot_dataset")
    root = export_lerobot(sorted(demos.glob("episode_*.npz")), tmp_path / "ds")
    ds = lerobot_dataset.LeRobotDataset("local/wamrt_sim", root=root, video_backend="pyav")
    arrays, _ = load_episode(demos / "episode_000000.npz")
    assert len(ds) == len(arrays["actions"])
    for i in range(len(ds)):
        item = ds[i]
        np.testing.assert_array_equal(item["action"].numpy(), arrays["actions"][i])
