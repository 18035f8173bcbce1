"""The real-time runner against a real loopback server: prefix keys on the wire, real latency, wall clock."""

from __future__ import annotations

import time

import numpy as np
from oracle.fake_policy import FakePolicy

from wamrt.client.clocks import WallClock
from wamrt.client.realtime import PREFIX_KEY, PREFIX_MODE_KEY, RealtimeRunner
from wamrt.client.ws import PolicyClient
from wamrt.sample import sample_observation
from wamrt.serving import ServeConfig, ServerThread


def test_a_server_whose_policy_has_no_prefix_support_answers_prefix_requests():
    """The keys travel on the openpi websocket; the stand-in policy knows nothing of them and answers as usual."""
    obs = sample_observation(0)
    with ServerThread(FakePolicy(), ServeConfig(max_batch=2)) as server, PolicyClient(server.ws_url) as client:
        plain = client.infer(obs)
        prefix = np.tile(np.r_[obs["observation/joint_position"], 0.0].astype(np.float32), (5, 1))
        with_keys = client.infer({**obs, PREFIX_KEY: prefix, PREFIX_MODE_KEY: "inpaint"})
    assert np.asarray(with_keys["actions"]).shape == (32, 8)
    np.testing.assert_array_equal(with_keys["actions"], plain["actions"])


def test_added_latency_holds_replies_and_the_wall_clock_runner_measures_it():
    obs = sample_observation(1)
    config = ServeConfig(max_batch=2, added_latency_ms=150.0)
    with ServerThread(FakePolicy(), config) as server, PolicyClient(server.ws_url) as client:
        t0 = time.perf_counter()
        client.infer(obs)
        assert time.perf_counter() - t0 >= 0.15
        clock = WallClock(15.0)
        runner = RealtimeRunner(client, strategy="prefix", clock=clock)
        runner.start(0)
        t0 = time.perf_counter()
        for _ in range(30):  # 2 s at 15 Hz
            runner.step(obs)
        wall = time.perf_counter() - t0
        clock.close()
    log = runner.log
    assert 29 / 15 - 0.05 < wall < 30 / 15 + 0.5
    # 150 ms + the fake model's ~0 ms is 3 ticks of 66.7 ms (a loaded CI machine may need a tick or two more).
    assert len(log.delays) >= 2 and all(3 <= d <= 6 for d in log.delays), log.delays
    # The replies the runner took in (a request still in flight at the last tick is cut off by the shutdown).
    assert all(clock_ms >= 150 for clock_ms in clock.latencies_ms[:len(log.delays)]), clock.latencies_ms
    assert log.prefix_rows[1] >= 3  # the second request carried the committed rows (the server accepts them)
    first = log.delays[0]
    assert all(log.stalled[:first]) and not any(log.stalled[first:])  # never stood still after the first reply
