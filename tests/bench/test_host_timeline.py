"""`wamrt bench host-timeline` on the CPU (a tiny model, no CUDA graphs: wall marks and the profile), and the
critical-path arithmetic of its GPU marks."""

from __future__ import annotations

import json

import pytest
import torch

from wamrt.bench.host_timeline import summary
from wamrt.cli import main

STAGE_ORDER = ("encode_call", "encode_returned", "finish_droid_call", "finish_droid_returned", "denoise_call",
               "sequences_call", "sequences_returned", "denoise_returned", "returned")


def test_host_timeline_marks_a_request_in_order_and_leaves_the_engine_as_it_was(tmp_path, monkeypatch):
    from wamrt.engine import Engine, admission

    def patched() -> tuple:
        return (Engine._denoise, Engine._sequences, admission.encode_canvases, admission.finish_droid,
                torch.cuda.CUDAGraph.replay)

    before = patched()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "host-timeline", "--model", "tiny-qwen", "--tiny-vae", "--layers", "1", "--row", "E5",
               "--device", "cpu", "--warmup", "0", "--runs", "1", "--out", str(tmp_path)])
    assert rc == 0
    assert patched() == before
    r = json.loads((tmp_path / "host-timeline-tiny-qwen-E5.json").read_text())
    assert r["kind"] == "host-timeline" and r["git_sha"] and "--layers 1 --tiny-vae" in r["command"]
    assert (r["row"], r["steps"], r["recipe"], r["engine"]["attention"]) == ("E5", 4, "bf16", "auto")
    wall = r["wall_ms_p50"]
    assert [wall[k] for k in STAGE_ORDER] == sorted(wall[k] for k in STAGE_ORDER)
    assert r["total"]["p50_ms"] == pytest.approx(wall["returned"], abs=1e-3) and r["total"]["n"] == 1
    assert r["gpu_ms_p50"] == {} and "denoise_wait_for_host_ms" not in r["summary"]  # no graphs off CUDA
    assert r["summary"]["host_before_encode_call_ms"] == wall["encode_call"]
    assert {"vae_encode", "denoise"} <= set(r["stages_ms_p50"])
    profile = (tmp_path / "host-profile-tiny-qwen-E5.txt").read_text()
    assert "infer_batch" in profile and "_denoise" in profile


def test_host_timeline_refuses_an_unknown_row_before_building(tmp_path):
    with pytest.raises(SystemExit, match="unknown 'E9'"):
        main(["bench", "host-timeline", "--model", "tiny-qwen", "--row", "E9", "--device", "cpu",
              "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_summary_reads_the_critical_path_from_the_gpu_marks():
    wall = {"encode_call": 1.2, "vae_replay_call": 1.5, "denoise_call": 2.0, "denoise_replay_call": 2.6,
            "denoise_returned": 2.7, "returned": 57.0}
    gpu = {"vae_gpu_start": 1.6, "vae_gpu_end": 4.9, "denoise_gpu_start": 5.0, "denoise_gpu_end": 56.2}
    s = summary(wall, gpu, [0.1, 0.07, 0.3])
    assert s["denoise_wait_for_host_ms"] == 0.1  # the median request's
    assert s["vae_graph_gpu_ms"] == pytest.approx(3.3) and s["denoise_graph_gpu_ms"] == pytest.approx(51.2)
    assert s["after_denoise_graph_ms"] == pytest.approx(0.8)
    assert s["host_from_vae_call_to_denoise_call_ms"] == pytest.approx(1.1)
    assert s["encode_call_to_denoise_call_ms"] == pytest.approx(0.8)
    assert set(summary(wall, {}, [])) == {"host_before_encode_call_ms", "encode_call_to_denoise_call_ms",
                                          "after_denoise_returned_ms"}
