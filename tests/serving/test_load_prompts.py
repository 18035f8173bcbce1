"""Issue 13 on the CPU: lanes with different instructions (`wamrt bench load --prompts`), the prompt token
counts the server reports, `--prompt-width`, and a warm-up that captures every graph the mix needs."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from oracle.fake_policy import FakePolicy
from oracle.graph_standin import record_by_rerun

from wamrt.bench.load import plan_lanes, run_load
from wamrt.bench.prompts import MIXED_INSTRUCTIONS, load_prompts
from wamrt.cli import main
from wamrt.client import PolicyClient
from wamrt.pipeline.prompts import droid_prompt
from wamrt.pipeline.random_weights import VariableLengthTokenizer
from wamrt.serving import ServeConfig, ServerThread
from wamrt.serving.config import ServeConfigError


class TokenizingFake(FakePolicy):
    """The fake engine with the tokenizer `wamrt serve --model random:SIZE` uses (its chunks carry the raw
    instruction as their prompt, so the server counts the instruction's tokens)."""

    tokenizer = VariableLengthTokenizer(1000)


def tokens(text: str) -> int:
    return TokenizingFake.tokenizer.encode(text).und_len


# --- --prompt-width ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "match"), [
    (dict(prompt_bucket=0, prompt_width=192), "needs --prompt-bucket"),
    (dict(prompt_bucket=64, prompt_width=100), "not a multiple of --prompt-bucket 64.*use 128"),
    (dict(prompt_bucket=64, prompt_width=-64), "must be >= 0"),
    (dict(prompt_bucket=-1), "must be >= 0"),
])
def test_prompt_width_is_checked_naming_the_flag(kw: dict[str, int], match: str) -> None:
    with pytest.raises(ServeConfigError, match=match) as err:
        ServeConfig(**kw)
    assert err.value.flag == ("--prompt-bucket" if "prompt_width" not in kw else "--prompt-width")


def test_prompt_width_flag_reaches_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    from wamrt.cli import build_parser
    from wamrt.engine import EngineConfig
    from wamrt.serving.server import config_from_args

    args = build_parser().parse_args(["serve", "--prompt-bucket", "64", "--prompt-width", "192", "--batch-invariant"])
    config = config_from_args(args)
    settings = config.engine_settings("cpu")
    assert settings["prompt_width"] == 192 and settings["prompt_bucket"] == 64 and settings["isolate_requests"]
    assert EngineConfig(**settings).prompt_width == 192
    # A bad width fails at once, before the (missing) model is looked at.
    assert main(["serve", "--model", "/no/such/model", "--prompt-bucket", "64", "--prompt-width", "100"]) == 2
    assert "--prompt-width: 100 is not a multiple" in capsys.readouterr().err


# --- the server reports what it ran ------------------------------------------------------------------------
def test_replies_carry_the_prompt_token_count(obs: dict[str, Any]) -> None:
    with ServerThread(TokenizingFake(), ServeConfig(max_batch=2)) as server, PolicyClient(server.ws_url) as client:
        short = client.infer({**obs, "prompt": "wave"})["metadata"]["prompt_tokens"]
        long = client.infer({**obs, "prompt": MIXED_INSTRUCTIONS[-1]})["metadata"]["prompt_tokens"]
    assert (short, long) == (tokens("wave"), tokens(MIXED_INSTRUCTIONS[-1])) and short < long
    with ServerThread(FakePolicy(), ServeConfig(max_batch=2)) as server, PolicyClient(server.ws_url) as client:
        assert "prompt_tokens" not in client.infer(obs)["metadata"]  # no tokenizer: nothing made up


# --- wamrt bench load --prompts ---------------------------------------------------------------------------
def test_lanes_start_at_different_prompts_and_prime_every_one() -> None:
    observations = [{"prompt": p} for p in MIXED_INSTRUCTIONS]
    plans = plan_lanes(observations, lanes=8, warmup=1, requests=100)
    firsts = [plan.cycle[0]["prompt"] for plan in plans]
    assert len(set(firsts)) == 8  # one batch of 8 lanes mixes 8 instructions
    primed = [o["prompt"] for plan in plans for o in plan.warmup]
    assert sorted(set(primed)) == sorted(MIXED_INSTRUCTIONS)  # every prefix cached before measuring
    assert {plan.measured for plan in plans} == {13}  # ceil(100 / 8)
    (one,) = plan_lanes([{"prompt": "a"}], lanes=1, warmup=2, requests=None)
    assert len(one.warmup) == 2 and one.measured is None  # one prompt: plain warm-up, run until the deadline


def test_bench_load_prompt_file_by_request_count(tmp_path, obs: dict[str, Any],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = ["wave", "", "open the drawer  ", MIXED_INSTRUCTIONS[-1]]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    assert load_prompts(str(prompts)) == ["wave", "open the drawer", MIXED_INSTRUCTIONS[-1]]
    out = tmp_path / "row.json"
    with ServerThread(TokenizingFake(delay=0.01), ServeConfig(max_batch=4, max_wait_ms=5)) as server:
        rc = main(["bench", "load", "--url", server.ws_url, "--lanes", "2", "--requests", "7", "--prompts",
                   str(prompts), "--model", "fake", "--out", str(out)])
        assert rc == 0
        row = json.loads(out.read_text())
        # A baseline of other instructions does not compare: refused before any request is sent.
        calls = len(server.service.policy.calls)
        assert main(["bench", "load", "--url", server.ws_url, "--prompts", "mixed", "--model", "fake",
                     "--baseline", str(out)]) == 2
        assert len(server.service.policy.calls) == calls
    assert "baseline prompts" in capsys.readouterr().err
    assert row["requests"] == 8 and row["stopped_by"] == "requests"  # ceil(7 / 2) per lane
    assert row["prompts"] == str(prompts) and row["distinct_prompts"] == 3
    assert row["prompt_lengths"] == sorted({tokens("wave"), tokens("open the drawer"), tokens(MIXED_INSTRUCTIONS[-1])})
    assert row["graph_captures_after_warmup"] is None  # this server has no CUDA graphs to count
    lo, hi = row["p50_ci95_ms"]
    assert lo <= row["p50_ms"] <= hi
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main(["bench", "load", "--prompts", str(tmp_path / "empty.txt")]) == 2
    assert main(["bench", "load", "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "not a file" in capsys.readouterr().err


def _graph_engine(policy: Any, **kw: Any) -> Any:
    from wamrt.engine import Engine, EngineConfig

    class RerunGraphEngine(Engine):
        def _record(self, entry, run):
            return record_by_rerun(entry, run)

    engine = RerunGraphEngine.from_policy(policy, EngineConfig(**ServeConfig(**kw).engine_settings("cpu")))
    engine.config = replace(engine.config, cuda_graph=True)  # the graph path (and its warm-up), minus the GPU
    return engine


def test_declared_width_warm_up_leaves_mixed_prompts_nothing_to_capture(tiny_policy: Any) -> None:
    """Two instructions of different 64-token buckets. With --prompt-width covering both, the server's warm-up
    captured every graph they replay: 0 captures during the row. One lane, batch 1, no lane warm-up: on the
    CPU a graph's stand-in costs a full model run per capture and replay."""
    mix = ["wave", "open the drawer"]  # 374 and 385 tokens under tiny-droid's byte-level tokenizer
    lengths = sorted(tiny_policy.tokenizer.encode(droid_prompt(p, json_format=False, canvas_hw=(540, 640))).und_len
                     for p in mix)
    width = -(-lengths[-1] // 64) * 64
    assert -(-lengths[0] // 64) * 64 < width  # different buckets: without a declared width, two graphs
    config = dict(steps=1, max_batch=1, prompt_bucket=64, prompt_width=width)
    engine = _graph_engine(tiny_policy, **config)
    with ServerThread(engine, ServeConfig(**config)) as server:
        row = run_load(server.ws_url, lanes=1, requests=2, warmup=0, prompts=mix)
    assert row["prompt_lengths"] == lengths and row["errors"] == {}
    assert row["graph_captures_after_warmup"] == 0
    assert [g.width for g in engine.graphs] == [width]  # the one graph warm-up captured, at the declared width


class CapturingFake(TokenizingFake):
    """Counts a "capture" per new batch size, like an engine without compatible replays."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.sizes: set[int] = set()

    def infer_batch(self, observations, **kw):
        self.sizes.add(len(observations))
        return super().infer_batch(observations, **kw)

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "engine": {"graphs": [{"batch": n} for n in sorted(self.sizes)]}}

    def graph_stats(self) -> dict[str, Any]:
        return {"captures": len(self.sizes), "evictions": 0, "entries": len(self.sizes), "bytes": 0,
                "capture_seconds": [0.1] * len(self.sizes)}


def test_graph_captures_during_a_row_are_counted_from_the_metrics() -> None:
    """Warm-up ran batch 1; a row of one lane adds nothing, a row of two lanes (batches of 2) adds one."""
    with ServerThread(CapturingFake(delay=0.02), ServeConfig(max_batch=2, max_wait_ms=20)) as server:
        one = run_load(server.ws_url, lanes=1, requests=2, prompts=["wave"])
        two = run_load(server.ws_url, lanes=2, requests=4, prompts=["wave", "open the drawer"])
    assert one["graph_captures_after_warmup"] == 0 and one["prompt_lengths"] == [tokens("wave")]
    assert two["graph_captures_after_warmup"] == 1 and two["batch_hist"] == {"2": 4}
    assert two["prompt_lengths"] == sorted({tokens("wave"), tokens("open the drawer")})


def test_the_fleet_set_spans_one_to_over_250_instruction_tokens() -> None:
    """Issue 40's mix: at least nine instructions from 1 to >= 250 tokens of their own (tokens, not characters,
    under `random:SIZE`'s tokenizer), within `wamrt serve`'s default limit, across its two prefix widths."""
    from wamrt.bench.prompts import FLEET_INSTRUCTIONS
    from wamrt.serving.config import ServeConfig

    own = sorted(len(TokenizingFake.tokenizer.pieces(p)) for p in FLEET_INSTRUCTIONS)
    assert len(own) >= 9 and own[0] == 1 and own[-1] >= 250
    assert own[-1] <= ServeConfig.max_prompt_tokens and len(set(own)) == len(own)
    captions = [tokens(droid_prompt(p, json_format=False, canvas_hw=(540, 640))) for p in FLEET_INSTRUCTIONS]
    assert min(captions) <= 256 < max(captions) <= 512  # both default widths of random:nano (tests/serving/...)
    assert load_prompts("fleet") == list(FLEET_INSTRUCTIONS)


def test_a_server_capturing_in_the_background_reports_its_warm_up_and_no_request_waits(tiny_policy: Any) -> None:
    """Issue 40 on the CPU: the server is ready before its graphs (batch ladder 1, 2 x two prefix widths) are
    captured; /readyz reports their progress; the load row waits for them and then counts no capture and no request
    that waited for one, with every field the GPU bars read."""
    import httpx

    mix = ["wave", "open the drawer"]
    lengths = sorted(tiny_policy.tokenizer.encode(droid_prompt(p, json_format=False, canvas_hw=(540, 640))).und_len
                     for p in mix)
    widths = tuple(-(-n // 64) * 64 for n in lengths)
    config = dict(steps=1, max_batch=2, prompt_bucket=64, batch_ladder=(1, 2), prompt_widths=widths)
    engine = _graph_engine(tiny_policy, **config)
    with ServerThread(engine, ServeConfig(**config)) as server:
        early = httpx.get(server.http_url + "/readyz").json()
        row = run_load(server.ws_url, lanes=2, requests=4, warmup=0, prompts=mix)
        late = httpx.get(server.http_url + "/readyz").json()
    assert early["ready"] and early["warmup"]["graphs"]["planned"] == 4
    assert late["warmup"]["graphs"]["complete"] and late["warmup"]["graphs"]["captured"] == 4
    assert row["errors"] == {} and row["graph_captures_after_warmup"] == 0
    assert row["requests_waited_on_capture"] == 0 and row["requests_eager_while_capturing"] == 0
    assert row["warmup_s"] == early["warmup"]["seconds"] and row["graph_wait_s"] >= 0
    assert row["peak_gpu_gib"] is None and row["gpu_memory_cap_gib"] is None  # a CPU server has no allocator peak
    assert engine.graphs.stats()["captures_by_cause"] == {"request": 0, "warmup": 0, "background": 4}


def test_the_background_ladder_starts_after_the_generation_warm_up(tiny_policy: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation warm-up job and the ladder take turns at capturing (ops.capture_turn): the ladder starts once the
    jobs are done, so a graph's compile does not hold the job's captures up before /readyz turns 200."""
    from wamrt.serving.service import Service

    order: list[str] = []
    config = dict(steps=1, max_batch=2, prompt_bucket=64, batch_ladder=(1, 2), prompt_widths=(64,))
    engine = _graph_engine(tiny_policy, **config)
    plan = engine.plan_ladder
    monkeypatch.setattr(engine, "plan_ladder", lambda *a, **k: (order.append("ladder"), plan(*a, **k))[1])

    async def warm_up_generation(self: Service, text: str) -> None:
        order.append("generation")

    monkeypatch.setattr(Service, "warm_up_generation", warm_up_generation)
    job = json.dumps({"size": "64x64", "num_frames": "5"})
    with ServerThread(engine, ServeConfig(**config, generation_warmup=(job, job))) as server:
        assert server.service.ready
    assert order == ["generation", "generation", "ladder"]


def test_a_lane_period_paces_each_lane_like_a_robot_and_baselines_must_match_it() -> None:
    """--lane-period-ms: a lane asks at most once per period (4 requests of ~20 ms at 150 ms take >= 3 periods),
    the row records it, and a baseline row at another period is refused (requests/s would not compare)."""
    from wamrt.bench.load import check_baseline

    with ServerThread(FakePolicy(delay=0.02), ServeConfig(max_batch=1)) as server:
        paced = run_load(server.ws_url, lanes=1, requests=4, warmup=0, prompts=["wave"], period_ms=150)
        free = run_load(server.ws_url, lanes=1, requests=4, warmup=0, prompts=["wave"])
    assert paced["lane_period_ms"] == 150 and paced["requests"] == 4
    assert paced["seconds"] >= 0.45 > free["seconds"]
    assert paced["p50_ms"] < 150  # latency is the request's own, not the wait for the next period
    check_baseline(paced, None, "fixed", 150)
    with pytest.raises(ValueError, match="lane_period_ms 150"):
        check_baseline(paced, None, "fixed", 0.0)
    with pytest.raises(ValueError, match="--lane-period-ms"):
        run_load(server.ws_url, lanes=1, requests=1, period_ms=-1)
