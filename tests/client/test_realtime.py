"""The robot-side runner: splicing at the arrival row, the four strategies, the delay estimate, both clocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from oracle.prefix_policy import StepPolicy, robot_obs

from wamrt.client.clocks import LatencyModel, SimClock, WallClock
from wamrt.client.realtime import PREFIX_KEY, PREFIX_MODE_KEY, DelayEstimator, RealtimeRunner


def run_logged(runner: RealtimeRunner, steps: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Drive the runner for `steps` ticks against the fake robot; returns the rows and the ticks requests left at."""
    runner.start(seed)
    rows, sent = [], []
    for t in range(steps):
        progress = len(runner.log.stalled) - sum(runner.log.stalled)  # rows the arm has run so far
        before = runner.requests
        rows.append(runner.step(lambda p=progress: robot_obs(p)))
        if runner.requests > before:
            sent.append(t)
    return np.stack(rows), sent


def run(runner: RealtimeRunner, steps: int, seed: int = 0) -> np.ndarray:
    return run_logged(runner, steps, seed)[0]


def ran_in_order(rows: np.ndarray, stalled: list[bool]) -> bool:
    """The rows the arm ran read 0, 1, 2, ... (the fake robot's odometer): every reply was spliced after the rows
    the arm had run meanwhile -- none skipped, none run twice."""
    moving = rows[~np.asarray(stalled), 0]
    return bool(np.array_equal(moving, np.arange(len(moving))))


@pytest.mark.parametrize("strategy", ["async", "blend", "prefix"])
def test_rows_are_spliced_at_the_step_they_arrive_under_jittered_latency(strategy):
    policy = StepPolicy()
    latency = LatencyModel(p50_ms=300.0, p99_ms=900.0)  # d from 5 to ~14 steps at 15 Hz
    runner = RealtimeRunner(policy, strategy=strategy, clock=SimClock(latency))
    rows, sent = run_logged(runner, 200, seed=3)
    log = runner.log
    assert len(set(log.delays)) >= 3  # jittered
    assert log.delays == [latency.delay(3, i) for i in range(len(log.delays))]  # seeded per (episode, request)
    first = log.delays[0]
    assert all(log.stalled[:first]) and not any(log.stalled[first:])  # only the first reply is waited for
    if strategy != "blend":  # the first chunk runs from its row 0, every later one from the row the arm reached
        assert ran_in_order(rows, log.stalled)
        np.testing.assert_array_equal(rows[first:, 0], np.arange(200 - first))
    # The chunk column changes only where a reply was spliced: at its arrival step.
    arrivals = [step + delay for step, delay in zip(sent, log.delays)]
    switches = [t for t in range(1, 200) if log.chunk[t] != log.chunk[t - 1]]
    assert switches == [a for a in arrivals[:len(switches)] if a < 200]


def test_sync_holds_while_waiting_and_runs_the_chunk_from_row_zero():
    runner = RealtimeRunner(StepPolicy(), strategy="sync", clock=SimClock(3))
    rows = run(runner, 30)
    held = np.array(runner.log.stalled)
    # request at 0 -> arrives 3 -> 8 rows (3..10) -> request at 11 -> arrives 14 -> rows 14..21 -> request at 22 ...
    assert held[[0, 1, 2, 11, 12, 13, 22, 23, 24]].all() and held.sum() == 9
    np.testing.assert_array_equal(rows[3:11, 0], np.arange(8))  # the chunk of step 0, run late from row 0
    np.testing.assert_array_equal(rows[14:22, 0], 8 + np.arange(8))  # observed at 11, where the arm had run 8
    assert ran_in_order(rows, runner.log.stalled)
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
    rows, sent = run_logged(runner, 40)
    assert PREFIX_KEY not in policy.requests[0]  # nothing was queued at step 0: the arm stood, committed to nothing
    # The first chunk arrives at 4 and runs from its row 0; the next request leaves 8 rows later, at 12, and the
    # reply arrives at 16: the 4 rows the arm runs meanwhile (the old chunk's rows 8..11) are the prefix.
    assert sent[:2] == [0, 12]
    second = policy.requests[1]
    assert int(second["observation/joint_position"][0]) == 8 and second[PREFIX_MODE_KEY] == "clean"
    np.testing.assert_array_equal(second[PREFIX_KEY][:, 0], [8, 9, 10, 11])  # exactly the rows run at 12..15
    np.testing.assert_array_equal(second[PREFIX_KEY][:, 1], 0)
    np.testing.assert_array_equal(rows[12:16], second[PREFIX_KEY])
    np.testing.assert_array_equal(rows[16:20, 1], 1)  # the new chunk from its row 4 on
    assert ran_in_order(rows, runner.log.stalled)


def test_prefix_longer_than_the_delay_is_spliced_inside_the_prefix():
    """Over-estimating d is harmless: a reply that arrives early is spliced where its rows still equal the old."""
    policy = StepPolicy()
    class Pessimist(DelayEstimator):
        def estimate(self) -> int:  # keeps planning for 6 while replies take 2 steps
            return 6

    runner = RealtimeRunner(policy, strategy="prefix", clock=SimClock(2), estimator=Pessimist())
    rows, sent = run_logged(runner, 30)
    assert runner.log.prefix_rows == [0, 6, 6, 6] and sent == [0, 10, 18, 26]
    assert runner.log.chunk[11:13] == [0, 1]  # the reply to step 10 arrived at 12 ...
    np.testing.assert_array_equal(rows[12:16, 1], 0)  # ... but its rows 2..5 are the prefix: the old chunk's rows
    assert rows[16, 1] == 1
    assert ran_in_order(rows, runner.log.stalled)
    # The first request had nothing committed, so it carried no prefix (standing rows are never sent): the arm
    # stood at its measured pose until the reply came at 2, then ran the first chunk from its row 0.
    assert PREFIX_KEY not in policy.requests[0]
    np.testing.assert_array_equal(rows[:2], 0)
    np.testing.assert_array_equal(rows[2:8, 0], np.arange(6))


def test_prefix_seam_cross_fades_the_rows_after_the_prefix_from_the_old_plan():
    """seam_rows = 3: the reply's 3 rows after the prefix run (1 - w) * old plan + w * reply, w = 1/4, 2/4, 3/4;
    the prefix rows themselves and every row after the seam are the reply's. Without it the switch is at once."""
    outs = {}
    for seam in (0, 3):
        runner = RealtimeRunner(StepPolicy(), strategy="prefix", clock=SimClock(4), seam_rows=seam)
        outs[seam] = run(runner, 40)
    plain, seamed = outs[0], outs[3]
    # the reply to step 12 arrives at 16 with a 4-row prefix (run at 12..15): rows 16.. are the new chunk's
    # (column 1 = 1); the first reply carried no prefix and so has no seam
    np.testing.assert_array_equal(plain[16:20, 1], 1)
    np.testing.assert_allclose(seamed[16:20, 1], [1 / 4, 2 / 4, 3 / 4, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(seamed[:16], plain[:16])  # the first chunk and the prefix itself are untouched
    np.testing.assert_allclose(seamed[16:20, 0], [12, 13, 14, 15])  # old plan and reply agree on the odometer
    np.testing.assert_array_equal(seamed[20:24], plain[20:24])
    lock_step = RealtimeRunner(StepPolicy(), strategy="prefix", clock=SimClock(0), seam_rows=3)
    np.testing.assert_array_equal(run(lock_step, 40), run(RealtimeRunner(StepPolicy(), clock=SimClock(0)), 40))
    with pytest.raises(ValueError, match="seam_rows"):
        RealtimeRunner(StepPolicy(), seam_rows=-1)


class HedgingGripper(StepPolicy):
    """Every reply's gripper column hedges: 0.1, 0.35, 0.6, 0.85, 0.1, ... (a chunk unsure when to release)."""

    def infer(self, obs):
        reply = super().infer(obs)
        prefix_rows = len(obs.get(PREFIX_KEY, ()))
        reply["actions"][prefix_rows:, 7] = 0.1 + 0.25 * (np.arange(self.chunk - prefix_rows) % 4)
        return reply


@pytest.mark.parametrize("strategy", ["async", "blend", "prefix"])
def test_binary_gripper_rounds_every_row_the_arm_runs_and_every_prefix_it_sends(strategy):
    """With binary_gripper the arm runs only 0 or 1 in the gripper column (rounded at 0.5, after blend's fade), the
    committed rows a prefix request carries are those rounded rows, and the joint columns are untouched."""
    raw_policy, rounded_policy = HedgingGripper(), HedgingGripper()
    raw = run(RealtimeRunner(raw_policy, strategy=strategy, clock=SimClock(3)), 60)
    rounded_runner = RealtimeRunner(rounded_policy, strategy=strategy, clock=SimClock(3), binary_gripper=True)
    rounded = run(rounded_runner, 60)
    moving = ~np.asarray(rounded_runner.log.stalled)
    assert set(np.unique(rounded[moving, 7])) == {0.0, 1.0}
    assert len(np.unique(raw[moving, 7])) > 2  # without it the hedged values reach the gripper
    np.testing.assert_array_equal(rounded[:, :7], raw[:, :7])
    np.testing.assert_array_equal(rounded[moving, 7], (raw[moving, 7] > 0.5).astype(np.float32))
    prefixes = [r[PREFIX_KEY] for r in rounded_policy.requests if PREFIX_KEY in r]
    assert (strategy == "prefix") == bool(prefixes)
    assert all(set(np.unique(p[:, 7])) <= {0.0, 1.0} for p in prefixes)


def test_blend_cross_fades_over_the_delay():
    runner = RealtimeRunner(StepPolicy(), strategy="blend", clock=SimClock(2))
    rows = run(runner, 20)
    # the chunk of step 10 arrives at 12: rows 12, 13 mix old (column 1 = 0) and new (1) with weights 1/3, 2/3
    np.testing.assert_allclose(rows[12:15, 1], [1 / 3, 2 / 3, 1.0], rtol=1e-6)
    np.testing.assert_allclose(rows[12:15, 0], [10, 11, 12])  # both chunks agree on the odometer column
    # The first chunk arrives at 2 to an arm standing at the observed pose (column 0 = 0) and runs from its row 0,
    # faded in from the standing pose.
    np.testing.assert_allclose(rows[2:5, 0], [0, 2 / 3, 2], rtol=1e-6)


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
    release = {0: 2, 1: 15, 2: 23}  # request k's reply lands just before tick release[k]
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
        progress = len(runner.log.stalled) - sum(runner.log.stalled)
        rows.append(runner.step(lambda p=progress: robot_obs(p)))
    clock.close()
    assert runner.log.delays == [2, 5, 5]  # sent at 0, 10 (8 rows after the first chunk began), 18
    assert abs(fake_now[0] - 25 / 15) < 1e-9 and clock.overruns == 0  # 25 periods of 1/15 s
    rows = np.stack(rows)
    np.testing.assert_array_equal(rows[2:, 0], np.arange(24))
    assert runner.log.chunk[14] == 0 and runner.log.chunk[15] == 1 and runner.log.chunk[23] == 2


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
    np.testing.assert_array_equal(rows[4:, 0], np.arange(36))  # ... ignored, and every row still runs in order
    assert runner.log.chunk[16] == 1 and rows[16, 1] == 1


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


def test_stalls_after_the_first_chunk_are_counted_apart_from_the_wait_for_it():
    from wamrt.eval.realtime import episode_metrics

    for strategy, after in (("sync", 6), ("prefix", 0)):  # sync stands 3 ticks per later request too
        runner = RealtimeRunner(StepPolicy(), strategy=strategy, clock=SimClock(3), prefix_mode="clean")
        run(runner, 30)
        m = episode_metrics(runner.log)
        assert runner.log.stalled[:3] == [True] * 3  # every strategy waits for the first chunk
        assert m["stalled"] == 3 + after and m["stalled_after_first_chunk"] == after
