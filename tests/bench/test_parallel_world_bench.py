"""`wamrt bench parallel --world`: which layouts run at which GPU counts, and a dry run with gloo on CPU processes
(the same code the multi-GPU run uses; its times here mean nothing)."""

from __future__ import annotations

import json

import pytest

from wamrt.bench.parallel_world import configurations
from wamrt.cli import main


def test_each_layout_runs_where_it_fits():
    assert configurations(["cfg", "ulysses", "cfg+ulysses"], [1, 2, 4, 8]) == [
        ("single", 1, None), ("cfg", 2, "cfg,ulysses"), ("ulysses", 2, "ulysses"), ("ulysses", 4, "ulysses"),
        ("cfg+ulysses", 4, "cfg,ulysses"), ("ulysses", 8, "ulysses"), ("cfg+ulysses", 8, "cfg,ulysses")]
    assert configurations(["cfg"], [4]) == []  # CFG alone has two branches: two GPUs


@pytest.mark.slow
def test_world_bench_dry_run_on_cpu_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path / "cache"))
    rc = main(["bench", "parallel", "--world", "--device", "cpu", "--model", "tiny-qwen", "--tiny-vae",
               "--size", "64x48", "--frames", "9", "--steps", "2", "--world-runs", "1", "--gpu-counts", "1,2",
               "--layouts", "cfg,ulysses", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "world-parallel.json").read_text())["rows"]
    assert [(r["parallel"], r["gpus"]) for r in rows] == [("single", 1), ("cfg", 2), ("ulysses", 2)]
    for r in rows:
        assert r["kind"] == "latency" and r["unit"] == "denoising step" and r["n"] == 2 and r["p50_ms"] > 0
        assert r["steps_per_s"] == pytest.approx(1e3 / r["p50_ms"]) and "speedup_vs_1gpu" in r
        assert len(r["peak_mem_gib_per_gpu"]) == r["gpus"]
        assert r["generator_tokens_per_branch"] == 3 * 2 * 2  # 3 latent frames of 2 x 2 patches
