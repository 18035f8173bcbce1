"""`wamrt serve` fails fast (issue 40): the port, the checkpoint folder and the memory plan are checked before any
weight loads, every startup error is one line naming the flag or file; the plan shows in /v1/metadata and the
summary line; /readyz reports the warm-up; an out-of-memory is rerun alone or answered with a typed 503."""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from wamrt.cli import build_parser, main
from wamrt.sample import sample_observation
from wamrt.serving import ServerThread


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """load_policy replaced by one that records its call and refuses: a test passes only if nothing loads."""
    calls: list[str] = []

    def refuse(name: Any, **kw: Any) -> Any:
        calls.append(str(name))
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("wamrt.pipeline.policy.load_policy", refuse)
    return calls


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("wamrt serve:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_taken_port_fails_before_the_model_loads(no_loading, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "tiny-droid", "--port", str(port)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--port {port}" in line and "in use" in line and no_loading == []


def test_a_failed_warm_up_stops_the_server_with_one_line(capsys) -> None:
    """A server that cannot warm up exits (status 1) instead of staying up and never ready: here a
    --generation-warmup job the server refuses (a width that is no multiple of the 16-pixel patch)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    refused = '{"size": "50x32", "num_frames": "5"}'
    code = main(["serve", "--model", "tiny-world", "--device", "cpu", "--port", str(port), "--steps", "1",
                 "--generation-warmup", refused])
    assert code == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("wamrt serve: warm-up failed: InvalidRequest: size:") and "multiples of 16" in line
    with socket.socket() as again:  # the port was given back
        again.bind(("127.0.0.1", port))


def test_a_missing_or_empty_checkpoint_folder_fails_before_loading(no_loading, capsys, tmp_path) -> None:
    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    assert "--model" in _one_line(capsys.readouterr().err)
    (tmp_path / "transformer").mkdir()
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "no transformer" in _one_line(capsys.readouterr().err)
    assert main(["serve", "--model", "random:nano@no-such-recipe"]) == 2
    assert "unknown recipe" in _one_line(capsys.readouterr().err)
    assert no_loading == []


def test_a_plan_that_does_not_fit_fails_before_loading_naming_the_part(no_loading, capsys) -> None:
    """Nano's bf16 weights on a 24 GiB card: refused from the config alone (the plan needs no GPU), naming the part
    and the recipe to use instead; the port is free again afterwards."""
    assert main(["serve", "--model", "random:nano", "--gpu-memory", "24", "--device", "cpu", "--port", "0"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "memory plan: weights" in line and "gen-fp8+reasoner-w8" in line and no_loading == []
    assert main(["serve", "--model", "random:nano", "--gpu-memory", "48", "--max-batch", "8", "--device", "cpu",
                 "--port", "0"]) == 2
    assert "--max-batch (asked: 8" in _one_line(capsys.readouterr().err)


def test_an_allocator_that_refuses_the_cap_is_one_line_before_loading(no_loading, capsys, monkeypatch) -> None:
    # On the H200 torch refused the cap for a device without an index (fixed in memory.cap_device); whatever the
    # allocator refuses is one line naming --gpu-memory, not a traceback.
    def refuse(plan: Any, device: str) -> None:
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr("wamrt.serving.memory.cap_device", refuse)
    assert main(["serve", "--model", "random:nano", "--gpu-memory", "80", "--device", "cpu", "--port", "0"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--gpu-memory 80: cannot cap the allocator" in line and "specified index" in line and no_loading == []


def test_the_plan_shows_in_metadata_and_the_summary_line_and_readyz_reports_the_warm_up(caplog) -> None:
    from wamrt.serving.server import config_from_args
    from wamrt.serving.startup import load

    args = build_parser().parse_args(["serve", "--model", "tiny-droid", "--device", "cpu", "--gpu-memory", "24",
                                      "--port", "0", "--steps", "1"])
    config = config_from_args(args)
    with caplog.at_level(logging.INFO, logger="wamrt.serving"):
        policy, sock, info = load(args, config)
        sock.close()
        plan = config.extra_metadata["memory_plan"]
        assert plan["capacity_gib"] == 24.0 and plan["total_gib"] <= 24.0 and plan["max_batch"] == 8
        assert {"weights", "step_kv_arena", "graph_pool", "generation"} <= set(plan["parts"])
        assert config.max_video_pixels == plan["max_video_pixels"]  # the flag was left to the plan
        server = ServerThread(policy, config)
        server.service.startup_info = info
        with server:
            meta = httpx.get(server.http_url + "/v1/metadata").json()
            ready = httpx.get(server.http_url + "/readyz").json()
    assert meta["memory_plan"] == plan
    assert ready["ready"] and ready["warmup"]["seconds"] is not None
    assert any(r.getMessage().startswith("memory plan: ") for r in caplog.records)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wamrt serve ready:")]
    assert len(summary) == 1 and "tiny-droid" in summary[0] and "of 24.0 GiB" in summary[0]


class _OutOfMemory:
    """`_denoise` stand-in: raises torch.OutOfMemoryError for batches larger than `fits` (0: always)."""

    def __init__(self, engine: Any, fits: int) -> None:
        self.denoise, self.fits = engine._denoise, fits

    def __call__(self, preps, opts):
        if self.fits == 0 or len(preps) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 GiB (injected)")
        return self.denoise(preps, opts)


def test_an_out_of_memory_batch_runs_again_one_request_at_a_time(tiny_policy: Any) -> None:
    from wamrt.engine import Engine, EngineConfig

    engine = Engine.from_policy(tiny_policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    obs = [sample_observation(0), sample_observation(1)]
    want = [c.actions for c in engine.infer_batch(obs, seeds=[3, 4], steps=1)]
    engine._denoise = _OutOfMemory(engine, fits=1)  # type: ignore[method-assign]
    got = [c.actions for c in engine.infer_batch(obs, seeds=[3, 4], steps=1)]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= 2e-5
    assert engine.out_of_memory == {"retried": 2, "refused": 0}


def test_an_out_of_memory_request_gets_a_typed_503_and_the_server_keeps_serving(tiny_policy: Any) -> None:
    from wamrt.client.wire import packb, unpackb
    from wamrt.engine import Engine, EngineConfig
    from wamrt.serving import ServeConfig

    engine = Engine.from_policy(tiny_policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    with ServerThread(engine, ServeConfig(steps=1, max_batch=2)) as server:
        denoise = engine._denoise
        engine._denoise = _OutOfMemory(engine, fits=0)  # type: ignore[method-assign]
        body = packb(sample_observation(0))
        headers = {"content-type": "application/msgpack"}
        refused = httpx.post(server.http_url + "/v1/policy/infer", content=body, headers=headers, timeout=120)
        assert refused.status_code == 503 and unpackb(refused.content)["code"] == "out_of_memory"
        engine._denoise = denoise  # type: ignore[method-assign]
        served = httpx.post(server.http_url + "/v1/policy/infer", content=body, headers=headers, timeout=120)
        assert served.status_code == 200
        text = httpx.get(server.http_url + "/metrics").text
    assert "wamrt_out_of_memory_refused_total 1.0" in text and 'wamrt_errors_total{code="out_of_memory"} 1.0' in text
