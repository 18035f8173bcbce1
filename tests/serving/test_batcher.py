"""Batcher unit tests (no sockets): grouping, bound, cancellation, staleness, one engine thread."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from oracle.fake_policy import FakePolicy

from wamrt.serving.batcher import Batcher, Job
from wamrt.serving.errors import Busy, StaleObservation


def _job(obs: dict[str, Any], **kw: Any) -> Job:
    return Job(obs, None, kw.pop("overrides", {}), **kw)


def test_concurrent_requests_share_one_infer_batch(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.05)
    b = Batcher(policy, max_batch=4, max_wait_ms=200, max_queue=16)
    try:
        futures = [b.submit(_job(obs)) for _ in range(4)]
        results = [f.result(5) for f in futures]
    finally:
        b.stop()
    assert policy.calls == [4]
    assert all(r.batch_size == 4 for r in results)
    assert policy.max_active == 1  # one engine thread, never two batches at once


def test_max_batch_and_buckets(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.05)
    b = Batcher(policy, max_batch=2, max_wait_ms=100, max_queue=16)
    try:
        futures = [b.submit(_job(obs)) for _ in range(3)]
        futures += [b.submit(_job(obs, overrides={"steps": 2}))]
        for f in futures:
            f.result(5)
    finally:
        b.stop()
    assert sorted(policy.calls) == [1, 1, 2]  # two of bucket A, one of A, one of bucket B (steps=2)


def test_bounded_queue_says_busy(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.3)
    b = Batcher(policy, max_batch=1, max_wait_ms=0, max_queue=2)
    try:
        first = b.submit(_job(obs))
        time.sleep(0.1)  # first is now running, the queue is empty
        queued = [b.submit(_job(obs)) for _ in range(2)]
        with pytest.raises(Busy):
            b.submit(_job(obs))
        for f in [first, *queued]:
            f.result(5)
    finally:
        b.stop()


def test_cancelled_job_leaves_queue_at_once(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.3)
    b = Batcher(policy, max_batch=1, max_wait_ms=0, max_queue=4)
    try:
        running = b.submit(_job(obs))
        time.sleep(0.1)
        waiting = b.submit(_job(obs))
        assert b.depth == 1
        assert waiting.cancel()
        assert b.depth == 0  # drained immediately, not when the engine gets to it
        running.result(5)
        time.sleep(0.1)
    finally:
        b.stop()
    assert policy.calls == [1]


def test_asyncio_cancellation_propagates(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.3)
    b = Batcher(policy, max_batch=1, max_wait_ms=0, max_queue=4)

    async def main() -> None:
        busy = asyncio.ensure_future(b.run(_job(obs)))
        await asyncio.sleep(0.1)
        waiter = asyncio.ensure_future(b.run(_job(obs)))
        await asyncio.sleep(0.01)
        assert b.depth == 1
        waiter.cancel()
        await asyncio.sleep(0.01)
        assert b.depth == 0
        await busy

    try:
        asyncio.run(main())
    finally:
        b.stop()


def test_stale_requests_never_run(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.3)
    b = Batcher(policy, max_batch=1, max_wait_ms=0, max_queue=4)
    try:
        running = b.submit(_job(obs))
        time.sleep(0.05)
        stale = b.submit(_job(obs, deadline=time.monotonic() + 0.05))  # expires while waiting
        running.result(5)
        with pytest.raises(StaleObservation):
            stale.result(5)
    finally:
        b.stop()
    assert policy.calls == [1]


def test_bad_item_fails_only_its_slot(obs: dict[str, Any]) -> None:
    policy = FakePolicy(delay=0.0)
    b = Batcher(policy, max_batch=2, max_wait_ms=200, max_queue=4)
    try:
        good, bad = b.submit(_job(obs)), b.submit(_job({**obs, "prompt": None}))
        assert good.result(5).chunk.actions.shape == (32, 8)
        with pytest.raises(ValueError, match="prompt"):
            bad.result(5)
    finally:
        b.stop()
    assert policy.calls == [2]


def test_warm_up_forms_every_batch_size_for_a_graph_engine():
    """An engine that captures one CUDA graph per batch size gets all of them at warm-up, largest first
    (the first capture sizes the K/V arena every later graph shares)."""
    from oracle.fake_policy import FakePolicy

    from wamrt.serving import ServeConfig, ServerThread

    class GraphEngine(FakePolicy):
        def metadata(self):
            return {**super().metadata(), "engine": {"cuda_graph": True}}

    policy = GraphEngine(delay=0.05)
    with ServerThread(policy, ServeConfig(max_batch=4, max_wait_ms=50.0, warmup_requests=1)):
        pass
    assert policy.calls[0] == 4, policy.calls
    assert set(range(1, 5)) <= set(policy.calls), policy.calls


def test_a_finished_job_is_freed_without_the_cycle_collector(obs: dict[str, Any]) -> None:
    """The job's future keeps its done-callbacks: one holding the job made a job <-> future cycle, and the
    observation (megabytes) waited for Python's full collection, minutes apart under load."""
    import gc
    import weakref

    b = Batcher(FakePolicy(), max_batch=1, max_wait_ms=0, max_queue=4)
    gc.disable()
    try:
        job = _job(obs)
        ref = weakref.ref(job)
        b.submit(job).result(5)
        del job
        assert ref() is None
    finally:
        gc.enable()
        b.stop()
