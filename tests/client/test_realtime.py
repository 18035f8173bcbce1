"""The robot-side runner: splicing at the arrival row, the four strategies, the delay estimate, both clocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from oracle.prefix_policy import StepPolicy, robot_obs

from wamrt.client.clocks import LatencyModel, SimClock, WallClock
from wamrt.client.realtime import PREFIX_KEY, PREFIX_MODE_KEY, DelayEstimator, RealtimeRunner


def run(runner: RealtimeRunner, steps: int, seed: int = 0) -> np.ndarray:
    runner.start(seed)
    return np.stack([runner.step(lambda t=t: robot_obs(t)) for t in range(steps)])


@pytest.mark.parametrize("strategy", ["async", "blend", "prefix"])
def test_rows_are_spliced_at_the_step_they_arrive_under_jittered_latency(strategy):
    policy = StepPolicy()
    latency = LatencyModel(p50_ms=300.0, p99_ms=900.0)  # d from 5 to ~14 steps at 15 Hz
    runner = RealtimeRunner(policy, strategy=strategy, clock=SimClock(latency))
    rows = run(runner, 200, seed=3)
    log = runner.log
    assert len(set(log.delays)) >= 3  # jittered
    assert log.delays == [latency.delay(3, i) for i in range(len(log.delays))]  # seeded per (episode, request)
    first = log.delays[0]
    assert all(log.stalled[:first]) and not any(log.stalled[first:])  # only the first reply is waited for
    if strategy != "blend":  # every executed row was planned for exactly the step it ran at
        np.testing.assert_array_equal(rows[first:, 0], np.arange(first, 200))
    # The chunk column changes only where a reply was spliced: at its arrival step.
    arrivals = []
    for req in policy.requests:
        step = int(req["observation/joint_position"][0])
        arrivals.append(step + log.delays[len(arrivals)])
    switches = [t for t in range(1, 200) if log.chunk[t] != log.chunk[t - 1]]
    assert switches == [a for a in arrivals[:len(switches)] if a < 200]


def test_sync_holds_while_waiting_and_runs_the_chunk_from_row_zero():
    runner = RealtimeRunner(StepPolicy(), strategy="sync", clock=SimClock(3))
    rows = run(runner, 30)
    held = np.array(runner.log.stalled)
    # request at 0 -> arrives 3 -> 8 rows (3..10) -> request at 11 -> arrives 14 -> rows 14..21 -> request at 22 ...
    assert held[[0, 1, 2, 11, 12, 13, 22, 23, 24]].all() and held.sum() == 9
    np.testing.assert_array_equal(rows[3:11, 0], np.arange(8))  # the chunk of step 0, run late from row 0
    np.testing.assert_array_equal(rows[14:22, 0], 11 + np.arange(8))
    np.testing.assert_array_equal(rows[11:14], np.repeat(rows[10:11], 3, axis=0))  # holds the last target


def test_zero_delay_is_lock_step_for_every_strategy():
    outs = []
    for strategy in ("sync", "async", "blend", "prefix"):
        policy = StepPolicy()
        rows = run(RealtimeRunner(policy, strategy=strategy, clock=SimClock(0)), 40)
        outs.append(rows)
        assert [int(r["observation/joint_position"][0]) for r in policy.requests] == [0, 8, 16, 24, 32]
        assert all(PREFIX_KEY not in r for r in policy.requests)  # nothing committed at d = 0
    for rows in outs[1:]:
        np.testing.assert_array_equal(rows, outs[0])


def test_prefix_carries_the_committed_rows_and_the_reply_continues_them():
    policy = StepPolicy()
    runner = RealtimeRunner(policy, strategy="prefix", clock=SimClock(4), prefix_mode="clean")
    rows = run(runner, 40)
    second = policy.requests[1]  # sent at step 8, the chunk of step 0 runs until the reply arrives at 12
    assert int(second["observation/joint_position"][0]) == 8 and second[PREFIX_MODE_KEY] == "clean"
    np.testing.assert_array_equal(second[PREFIX_KEY][:, 0], [8, 9, 10, 11])  # exactly the rows run at 8..11
    np.testing.assert_array_equal(second[PREFIX_KEY][:, 1], 0)
    np.testing.assert_array_equal(rows[8:12], second[PREFIX_KEY])
    np.testing.assert_array_equal(rows[12:16, 1], 1)  # the new chunk from its row 4 on


def test_prefix_longer_than_the_delay_is_spliced_inside_the_prefix():
    """Over-estimating d is harmless: a reply that arrives early is spliced where its rows still equal the old."""
    policy = StepPolicy()
    class Pessimist(DelayEstimator):
        def estimate(self) -> int:  # keeps planning for 6 while replies take 2 steps
            return 6

    runner = RealtimeRunner(policy, strategy="prefix", clock=SimClock(2), estimator=Pessimist())
    rows = run(runner, 30)
    assert runner.log.prefix_rows[1:] == [6, 6, 6]
    assert runner.log.chunk[9:11] == [0, 1]  # the reply to step 8 arrived at 10 ...
    np.testing.assert_array_equal(rows[10:14, 1], 0)  # ... but its rows 2..5 are the prefix: the old chunk's rows
    assert rows[14, 1] == 1
    np.testing.assert_array_equal(rows[6:, 0], np.arange(6, 30))
    # The first request had nothing committed: its prefix is the standing pose held for 6 rows, so the first
    # chunk starts from standstill (rows 2..5 stand) instead of jumping to its row 2.
    first = policy.requests[0][PREFIX_KEY]
    assert first.shape == (6, 8) and not first.any()
    np.testing.assert_array_equal(rows[:6], 0)


def test_prefix_seam_cross_fades_the_rows_after_the_prefix_from_the_old_plan():
    """seam_rows = 3: the reply's 3 rows after the prefix run (1 - w) * old plan + w * reply, w = 1/4, 2/4, 3/4;
    the prefix rows themselves and every row after the seam are the reply's. Without it the switch is at once."""
    outs = {}
    for seam in (0, 3):
        runner = RealtimeRunner(StepPolicy(), strategy="prefix", clock=SimClock(4), seam_rows=seam)
        outs[seam] = run(runner, 40)
    plain, seamed = outs[0], outs[3]
    # the reply to step 8 arrives at 12 with a 4-row prefix (8..11): rows 12.. are the new chunk's (column 1 = 1)
    np.testing.assert_array_equal(plain[12:16, 1], 1)
    np.testing.assert_allclose(seamed[12:16, 1], [1 / 4, 2 / 4, 3 / 4, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(seamed[8:12], plain[8:12])  # the prefix itself is untouched
    np.testing.assert_allclose(seamed[12:16, 0], [12, 13, 14, 15])  # old plan and reply agree on the step column
    np.testing.assert_array_equal(seamed[16:20], plain[16:20])
    lock_step = RealtimeRunner(StepPolicy(), strategy="prefix", clock=SimClock(0), seam_rows=3)
    np.testing.assert_array_equal(run(lock_step, 40), run(RealtimeRunner(StepPolicy(), clock=SimClock(0)), 40))
    with pytest.raises(ValueError, match="seam_rows"):
        RealtimeRunner(StepPolicy(), seam_rows=-1)


def test_blend_cross_fades_over_the_delay():
    runner = RealtimeRunner(StepPolicy(), strategy="blend", clock=SimClock(2))
    rows = run(runner, 20)
    # the chunk of step 8 arrives at 10: rows 10, 11 mix old (column 1 = 0) and new (1) with weights 1/3, 2/3
    np.testing.assert_allclose(rows[10:13, 1], [1 / 3, 2 / 3, 1.0], rtol=1e-6)
    np.testing.assert_allclose(rows[10:13, 0], [10, 11, 12])  # both chunks agree on the step column
    # The first chunk arrives at 2 to an arm standing at the observed pose (column 0 = 0): it fades in from there.
    np.testing.assert_allclose(rows[2:5, 0], [2 / 3, 2 * 3 / 3, 4], rtol=1e-6)


def test_delay_estimate_leaves_out_the_warm_up():
    est = DelayEstimator(window=4, quantile=1.0, warmup=1)
    assert est.estimate() == 0
    est.record(40)  # warm-up spike: stands in until a real delay is known, then is forgotten
    assert est.estimate() == 40
    for d in (3, 4, 3):
        est.record(d)
    assert est.estimate() == 4
    for d in (2, 2, 2, 2):
        est.record(d)
    assert est.estimate() == 2  # the window forgets


def test_latency_model_parses_and_counts_steps(tmp_path):
    assert LatencyModel.parse("606").delay(0, 0) == 10  # Nano bf16 at 15 Hz
    assert LatencyModel.parse("49").delay(0, 0) == 1
    assert LatencyModel(steps=0).delay(1, 2) == 0
    m = LatencyModel.parse("145,400")
    draws = [m.latency_ms(7, i) for i in range(4000)]
    assert abs(np.median(draws) / 145 - 1) < 0.05 and abs(np.quantile(draws, 0.99) / 400 - 1) < 0.15
    assert m.latency_ms(7, 3) == m.latency_ms(7, 3) != m.latency_ms(8, 3)
    f = tmp_path / "load.json"
    f.write_text('{"kind": "load", "p50_ms": 194.0, "p99_ms": 230.0}')
    assert LatencyModel.parse(str(f)).nominal_steps() == 3
    for bad in ("fast", "1,2,3", "-5", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError):
            LatencyModel.parse(bad)


class GatedPolicy(StepPolicy):
    """Each reply waits until the test lets it go, so the test decides the tick it arrives at."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[threading.Event] = []
        self.done: list[threading.Event] = []

    def infer(self, obs):
        gate, done = threading.Event(), threading.Event()
        self.gates.append(gate)
        self.done.append(done)
        gate.wait(5)
        out = super().infer(obs)
        done.set()
        return out


def test_wall_clock_splices_at_the_tick_the_reply_arrived():
    fake_now = [0.0]
    clock = WallClock(15.0, sleep=lambda s: fake_now.__setitem__(0, fake_now[0] + s), now=lambda: fake_now[0])
    policy = GatedPolicy()
    runner = RealtimeRunner(policy, strategy="async", clock=clock)
    runner.start(0)
    release = {0: 2, 1: 13, 2: 21}  # request k's reply lands just before tick release[k]
    rows = []
    for t in range(26):
        for k, tick in release.items():
            if tick == t:
                deadline = time.monotonic() + 5
                while len(policy.gates) <= k and time.monotonic() < deadline:  # the request thread has started
                    time.sleep(0.001)
                policy.gates[k].set()
                assert policy.done[k].wait(5)
                time.sleep(0.01)  # the executor marks its future done right after infer returns
        rows.append(runner.step(lambda t=t: robot_obs(t)))
    clock.close()
    assert runner.log.delays == [2, 5, 5]  # sent at 0, 8, 16
    assert abs(fake_now[0] - 25 / 15) < 1e-9 and clock.overruns == 0  # 25 periods of 1/15 s
    rows = np.stack(rows)
    np.testing.assert_array_equal(rows[2:, 0], np.arange(2, 26))
    assert runner.log.chunk[12] == 0 and runner.log.chunk[13] == 1 and runner.log.chunk[21] == 2


def test_openpi_style_policy_gets_its_seed_in_the_request_and_errors_can_be_survived():
    policy = StepPolicy()
    run(RealtimeRunner(policy, strategy="async", clock=SimClock(1)), 10, seed=5)
    assert all("seed" in r for r in policy.requests)

    class Broken:
        def infer(self, obs, seed=None):
            raise RuntimeError("busy")

    runner = RealtimeRunner(Broken(), strategy="prefix", clock=SimClock(1), raise_errors=False)
    rows = run(runner, 5)
    assert len(runner.log.errors) >= 2 and all(runner.log.stalled)
    np.testing.assert_array_equal(rows[:, 0], 0)  # held the measured pose
    with pytest.raises(RuntimeError, match="busy"):
        run(RealtimeRunner(Broken(), strategy="async", clock=SimClock(0)), 3)
    with pytest.raises(ValueError, match="strategy"):
        RealtimeRunner(policy, strategy="ensemble")


def test_a_policy_that_ignores_the_prefix_keys_still_runs_on_time():
    """A server / policy without prefix support answers as if no prefix was sent: the runner still splices at the
    arrival row (the rows are then the policy's own, as with async)."""
    policy = StepPolicy(honour_prefix=False)
    runner = RealtimeRunner(policy, strategy="prefix", clock=SimClock(4))
    rows = run(runner, 40)
    assert PREFIX_KEY in policy.requests[1]  # sent ...
    np.testing.assert_array_equal(rows[4:, 0], np.arange(4, 40))  # ... ignored, and every row is still on time
    assert runner.log.chunk[12] == 1 and rows[12, 1] == 1


def test_the_runner_speaks_the_servers_prefix_keys():
    """The runner repeats the request keys so that it imports no torch; they must be the pipeline's."""
    from wamrt.client import realtime
    from wamrt.pipeline import prefix

    assert (realtime.PREFIX_KEY, realtime.PREFIX_MODE_KEY) == (prefix.PREFIX_KEY, prefix.PREFIX_MODE_KEY)
    assert realtime.PREFIX_MODES == prefix.PREFIX_MODES and realtime.MAX_PREFIX == prefix.MAX_PREFIX_ROWS


def test_importing_the_runner_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; import wamrt.client.realtime, wamrt.client.clocks; "
            "print(sorted(m for m in ('torch', 'mujoco', 'websockets', 'msgpack') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
