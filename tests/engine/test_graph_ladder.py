"""Captures off the request path (`EngineConfig(capture_on_request=False)`, `graph_ladder.py`) on the CPU: a
stand-in records the loop, as in test_engine_cpu.py. No request waits for a capture: a batch without its graph
runs uncaptured or on smaller captured ones while the background thread captures it; the ladder is planned batch 1
first; every graph shares one pool."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
from oracle.graph_standin import record_by_rerun

from wamrt.engine import Engine, EngineConfig
from wamrt.sample import sample_observation

TOL = 2e-5
BUCKET = 64
SHORT = "pick up the cube"
LONG = ("pick up the red cube and put it on the blue pad, then push the green cylinder next to the yellow bowl and "
        "wave at the camera three times before you return to the start")


@pytest.fixture(scope="module")
def widths(policy) -> tuple[int, int]:
    """The prefix widths (whole buckets) of SHORT and LONG under the tiny model's tokenizer: two different ones."""
    out = []
    for prompt in (SHORT, LONG):
        caption = policy.infer(_prompted(0, prompt), seed=0, steps=1).prompt
        out.append(-(-policy.tokenizer.encode(caption).und_len // BUCKET) * BUCKET)
    assert out[0] < out[1]
    return out[0], out[1]


def _prompted(i: int, prompt: str) -> dict:
    obs = sample_observation(i)
    obs["prompt"] = prompt
    return obs


class StandInEngine(Engine):
    """The graph path on the CPU: `_record` runs the loop and a replay reruns it on the static inputs. `gate`, when
    set, holds every capture until it is set (a capture that takes long)."""

    gate: threading.Event | None = None
    recording = threading.Event()

    def _record(self, entry, run):
        self.recording.set()
        if self.gate is not None:
            assert self.gate.wait(60), "the test never released the capture"
        return record_by_rerun(entry, run)


def _engine(policy, **kw) -> StandInEngine:
    engine = StandInEngine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                            prompt_bucket=BUCKET, capture_on_request=False, **kw))
    engine.config = replace(engine.config, cuda_graph=True)  # the graph path, minus the CUDA check
    engine.recording = threading.Event()
    return engine


def _eager(policy) -> Engine:
    return Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))


def test_a_request_without_its_graph_runs_uncaptured_and_its_bucket_is_captured_in_the_background(policy):
    eager, engine = _eager(policy), _engine(policy)
    want = eager.infer(_prompted(0, SHORT), seed=3, steps=2).actions
    got = engine.infer(_prompted(0, SHORT), seed=3, steps=2).actions
    assert np.abs(got - want).max() <= TOL
    assert engine.wait_for_captures(60) and engine.capture_progress()["pending"] == 0
    assert engine.graphs.stats()["captures_by_cause"] == {"request": 0, "warmup": 0, "background": 1}
    again = engine.infer(_prompted(0, SHORT), seed=3, steps=2).actions  # now on its graph
    assert np.abs(again - want).max() <= TOL
    assert engine.graphs.requests["eager"] == 1 and engine.graphs.requests["exact"] == 1
    assert engine.graphs.requests["waited"] == 0
    engine.stop_background_capture()


def test_a_request_with_an_uncaptured_width_is_answered_while_a_capture_is_under_way(policy, widths):
    """The background thread is held inside a capture (as a 30 s Nano capture would hold it); a request of another
    prefix width gets its answer meanwhile, and the held capture finishes afterwards."""
    eager, engine = _eager(policy), _engine(policy, prompt_widths=(widths[0],), batch_ladder=(1, 2))
    engine.infer(_prompted(0, SHORT), seed=1, steps=1)  # wants (batch 1, the short width)
    assert engine.wait_for_captures(60)
    engine.recording.clear()
    engine.gate = threading.Event()
    engine.plan_ladder()  # (batch 2, the short width): held
    assert engine.recording.wait(30)
    progress = engine.capture_progress()
    assert progress["capturing"] is not None and not progress["complete"]
    answered = threading.Event()
    result = {}

    def request() -> None:
        result["actions"] = engine.infer(_prompted(1, LONG), seed=4, steps=1).actions
        answered.set()

    t = threading.Thread(target=request)
    t.start()
    assert answered.wait(120), "the request waited for the capture"
    assert not engine.gate.is_set() and engine.capture_progress()["capturing"] is not None
    assert np.abs(result["actions"] - eager.infer(_prompted(1, LONG), seed=4, steps=1).actions).max() <= TOL
    engine.gate.set()
    t.join()
    assert engine.wait_for_captures(120)
    stats = engine.graphs.stats()
    assert stats["requests"]["waited"] == 0 and stats["captures_by_cause"]["request"] == 0
    engine.stop_background_capture()


def test_the_ladder_is_planned_batch_one_first_widest_first_and_batches_split_over_it(policy, widths):
    """plan_ladder: every batch rung at every width rung, batch 1 first and the widest width first at each size. A
    batch larger than every captured rung runs as replays of them, each request its own actions."""
    short, long = widths
    eager, engine = _eager(policy), _engine(policy, prompt_widths=widths, batch_ladder=(1, 2))
    obs = [_prompted(0, SHORT), _prompted(1, LONG), _prompted(2, SHORT)]
    engine.infer(obs[0], seed=1, steps=2)
    planned = engine.plan_ladder()
    assert [(k.batch, k.width) for k in planned] == [(1, long), (1, short), (2, long), (2, short)]
    assert engine.wait_for_captures(120)
    progress = engine.capture_progress()
    assert progress["captured"] == progress["planned"] == 4 and progress["complete"] and progress["failed"] == 0
    want = [c.actions for c in eager.infer_batch(obs, seeds=[3, 4, 5], steps=2)]
    before = dict(engine.graphs.requests)
    got = [c.actions for c in engine.infer_batch(obs, seeds=[3, 4, 5], steps=2)]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= TOL
    assert engine.graphs.requests["split"] - before.get("split", 0) == 3  # 2 + 1 requests on the batch-2 graph
    engine.stop_background_capture()


def test_every_graph_shares_one_pool_and_the_stats_say_so(policy, widths):
    engine = _engine(policy, prompt_widths=widths, batch_ladder=(1, 2))
    engine.infer(_prompted(0, SHORT), seed=1, steps=1)
    engine.plan_ladder()
    assert engine.wait_for_captures(120)
    entries = [engine.graphs.get(k) for k in engine.graphs]
    assert len(entries) == 4 and len({id(e.pool) for e in entries}) == 1 and entries[0].pool is not None
    stats = engine.graph_stats()
    assert stats["pools"] == 1 and stats["pool_bytes"] == 0  # the CPU has no allocator pool to read
    assert stats["bytes"] == sum(e.nbytes for e in entries) > 0  # static inputs: what evicting one frees
    assert stats["arena_bytes"] == engine.kv_arena.arena.numel() * engine.kv_arena.arena.element_size()
    engine.stop_background_capture()


def test_a_request_served_while_its_graph_is_captured_never_compiles(policy):
    """A compiled engine's request without a graph runs the uncompiled layers (a new shape would compile on the
    request path): Dynamo sees no frame."""
    from torch._dynamo.utils import counters

    engine = StandInEngine.from_policy(policy, EngineConfig(attention="auto", compile=True, cuda_graph=False,
                                                            prompt_bucket=BUCKET, capture_on_request=False))
    engine.config = replace(engine.config, cuda_graph=True)
    engine.gate = threading.Event()  # the background capture (which would compile) is held, then abandoned

    def refuse(entry, run):
        assert engine.gate.wait(60)
        raise RuntimeError("capture abandoned by the test")

    engine._record = refuse  # type: ignore[method-assign]
    frames = counters["stats"]["calls_captured"]
    got = engine.infer(_prompted(0, SHORT), seed=3, steps=1).actions
    assert counters["stats"]["calls_captured"] == frames
    assert np.abs(got - _eager(policy).infer(_prompted(0, SHORT), seed=3, steps=1).actions).max() <= 1e-4
    assert engine.graphs.requests["eager"] == 1
    engine.gate.set()
    assert engine.wait_for_captures(60) and engine.capture_progress()["failed"] == 1
    engine.stop_background_capture()


def test_isolated_requests_still_capture_on_the_request_path(policy):
    """--batch-invariant: a request's bits must not depend on what was captured yet, so its own graph is captured
    before it runs, whatever capture_on_request says."""
    engine = _engine(policy, isolate_requests=True)
    engine.infer(_prompted(0, SHORT), seed=1, steps=1)
    stats = engine.graphs.stats()
    assert stats["captures_by_cause"]["request"] == 1 and stats["requests"]["waited"] == 1
    assert stats["requests"]["eager"] == 0


def test_an_engine_primes_inductors_one_symbolic_trace_before_threads_run(policy):
    """Inductor's first code generation makes one FX symbolic trace (a cached dummy module), and a symbolic trace
    patches `nn.Module.__call__` process-wide while it runs: a module another thread calls meanwhile raises
    NameError (a server's i2v warm-up job beside the compiling ladder, H100). Building an engine makes that trace,
    on the thread that builds it, before any server thread starts."""
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm.cache_clear()
    assert InterpreterShim._dummy_gm.cache_info().currsize == 0
    _eager(policy)
    assert InterpreterShim._dummy_gm.cache_info().currsize == 1
