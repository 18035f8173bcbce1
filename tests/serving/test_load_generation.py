"""`wamrt bench load --background-generation`: policy lanes measured while world-generation jobs run back to back
on the same server (the CPU rehearsal of `scripts/gpu_run.sh world-serve`), on the built-in `tiny-world`."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from wamrt.cli import main
from wamrt.serving import ServeConfig, ServerThread

# The sound tokenizer uses weight_norm (a FutureWarning on this torch).
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
# Image -> video at a tiny size: prefill + 2 steps + 2 decoded latent frames, a handful of device segments.
JOB = {"prompt": "a robot arm stacks blocks", "size": "64x48", "num_frames": "5", "num_inference_steps": "2",
       "guidance_scale": "6", "input_reference": "@sample"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    import wamrt

    os.environ.setdefault("WAMRT_CACHE", str(tmp_path_factory.mktemp("wamrt_cache")))
    policy = wamrt.load_policy("tiny-world", device="cpu")
    with ServerThread(policy, ServeConfig(model_name="tiny-world", steps=1, max_batch=4, max_wait_ms=2.0)) as s:
        yield s


def _load(server: ServerThread, out: Any, *extra: str) -> dict[str, Any]:
    rc = main(["bench", "load", "--url", server.ws_url, "--lanes", "1", "--prompts", "mixed", "--model", "tiny-world",
               "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_lanes_with_background_generation(server: ServerThread, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    quiet = _load(server, tmp_path / "a.json", "--seconds", "2")
    busy = _load(server, tmp_path / "b.json", "--seconds", "4", "--background-generation", json.dumps(JOB),
                 "--baseline", str(tmp_path / "a.json"))
    assert "background_generation" not in quiet
    # The lanes' own fields are the same with and without, so the rows compare; --baseline gives the ratios.
    assert set(quiet) <= set(busy)
    assert busy["requests"] > 0 and busy["errors"] == {}
    assert busy["p99_over_baseline_p99"] == pytest.approx(busy["p99_ms"] / quiet["p99_ms"])
    gen = busy["background_generation"]
    assert gen["fields"] == JOB and gen["endpoint"] == "/v1/videos/sync"
    assert gen["warmup_jobs"] == 1 and gen["jobs_completed"] > 0
    assert gen["jobs_failed"] == 0 and gen["first_error"] is None
    assert gen["jobs_cancelled_at_end"] <= 1
    job = gen["jobs"][0]
    assert job["bytes"] > 0 and job["wall_s"] >= job["timing"]["model_ms"] / 1e3  # the MP4, and X-Timing read
    assert gen["job_p50_s"] > 0 and gen["model_ms_p50"] > 0 and gen["paused_ms_p50"] is not None
    assert 0 < gen["segment_max_ms"] <= 1e3 * max(j["wall_s"] for j in gen["jobs"])
    # where in its job the longest segment ran, between two named yield points, and the job's stages (headers)
    points = gen["segment_max_span"].split(" -> ")
    assert len(points) == 2 and points[1] != "start"
    for point in points:
        assert point in ("start", "prepared", "reasoner prefilled", "denoised", "decoded frame", "sound", "done") \
            or re.fullmatch(r"step \d+( segment)?", point), gen["segment_max_span"]
    assert job["stages_s"]["vae_decode"] > 0
    # The server's counters (/metrics): generation's device time during the row, at least its finished jobs'.
    assert gen["segments"] >= gen["jobs_completed"] and 0 < gen["device_share"] < 1
    assert gen["device_s"] >= 0.9 * sum(j["timing"]["model_ms"] for j in gen["jobs"]) / 1e3 - 0.05
    assert "background generation:" in capsys.readouterr().out
    # A job still running when the lanes stopped was hung up on: the server cancels it, nothing runs on.
    worker, deadline = server.service.generation, time.monotonic() + 10
    while (worker.running is not None or worker.depth) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.running is None and worker.depth == 0


@pytest.mark.parametrize(("fields", "match"), [
    ("{not json", "not JSON"),
    ('["prompt"]', "JSON object"),
    ("{}", "JSON object"),
    ('{"prompt": "x", "input_reference": "@/no/such/picture.png"}', "not a file"),
])
def test_bad_fields_name_the_flag(fields: str, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "load", "--background-generation", fields])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --background-generation" in err and match in err


def test_a_job_the_server_refuses_stops_the_run_before_the_lanes(server: ServerThread, tmp_path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def ws_requests() -> float:
        return server.service.metrics.registry.get_sample_value("wamrt_requests_total", {"surface": "ws"}) or 0.0

    calls = ws_requests()
    rc = main(["bench", "load", "--url", server.ws_url, "--seconds", "1", "--out", str(tmp_path / "x.json"),
               "--background-generation", json.dumps({**JOB, "size": "50x50"})])
    assert rc == 2 and not (tmp_path / "x.json").exists()
    assert "warm-up job failed: HTTP 400 invalid_request (size)" in capsys.readouterr().err
    assert ws_requests() == calls  # no lane sent anything
