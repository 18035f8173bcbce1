"""The delay mode in the simulator: seeded replays, lock-step at d = 0, the expert planner's prefix, the grid."""

from __future__ import annotations

import json

import numpy as np
import pytest

from wamrt.client.clocks import LatencyModel
from wamrt.client.realtime import JOINT_KEY, PREFIX_KEY
from wamrt.eval.agents import PolicyAgent
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings
from wamrt.eval.runner import run_rollouts


class Chunk:
    def __init__(self, actions):
        self.actions = actions


class WigglePolicy:
    """Deterministic in (observation, seed): from the measured joints, a slow wiggle whose phase the seed sets
    (row 0 is the measured pose, as a policy's first row is near it), and the prefix where one is given. Answers
    like wamrt's Policy (`.actions`, `infer_batch`)."""

    def infer(self, obs, seed=None):
        rng = np.random.default_rng(seed)
        base = np.r_[np.asarray(obs[JOINT_KEY], np.float64), 0.0]
        t = np.arange(32)[:, None]
        phase = rng.uniform(0, 6.28, size=8)
        rows = base + 0.03 * (np.sin(0.3 * t + phase) - np.sin(phase))
        rows[:, 7] = 0.0
        prefix = np.asarray(obs.get(PREFIX_KEY, np.zeros((0, 8))))
        rows[: len(prefix)] = prefix
        return Chunk(rows.astype(np.float32))

    def infer_batch(self, observations, seeds=None):
        return [self.infer(o, s) for o, s in zip(observations, seeds, strict=True)]


def _run(strategy, latency, lanes=1, seeds=(3, 4)):
    policy = WigglePolicy()
    settings = RealtimeSettings(strategy, latency)
    return run_rollouts("pick_place", lambda: RealtimeAgent(policy, settings), list(seeds), lanes=lanes,
                        backend="thread", max_steps=30, env_kwargs={"exterior_hw": (32, 56)})


def test_delay_mode_replays_bit_for_bit_with_the_same_seed():
    latency = LatencyModel(p50_ms=200.0, p99_ms=600.0)  # jittered: d drawn per request
    a, b = _run("prefix", latency), _run("prefix", latency, lanes=2)
    for x, y in zip(a, b, strict=True):
        assert x.trace and x.trace == y.trace  # every request's observation and reply, digest for digest
        assert x.realtime["delays"] == y.realtime["delays"] and len(set(x.realtime["delays"])) >= 2
        assert x.realtime["delays"] == [latency.delay(x.seed, i) for i in range(len(x.realtime["delays"]))]
    assert a[0].trace != a[1].trace  # different seeds, different episodes
    c = _run("async", latency)
    assert c[0].trace != a[0].trace and c[0].realtime["delays"][:2] == a[0].realtime["delays"][:2]  # no prefix


def test_zero_delay_is_the_lock_step_rollout():
    lock = run_rollouts("pick_place", lambda: PolicyAgent(WigglePolicy(), execute_steps=8), [5], backend="thread",
                        max_steps=30, env_kwargs={"exterior_hw": (32, 56)})
    for strategy in ("sync", "prefix"):
        rt = _run(strategy, LatencyModel(steps=0), seeds=(5,))
        assert rt[0].trace == lock[0].trace and rt[0].steps == lock[0].steps
        assert rt[0].realtime["stalled"] == 0


def _turntable_observation(env):
    """Turntable seed 2, 20 expert steps in: the observation the planner tests plan from."""
    from wamrt.eval.planner import SIM_STATE_KEY, snapshot
    from wamrt.sim import ScriptedExpert

    env.reset(2, render=False)
    expert = ScriptedExpert()
    expert.reset(env)
    for _ in range(20):
        env.step(expert.act(env), render=False)
    return {SIM_STATE_KEY: snapshot(env, 2)}


def test_expert_planner_continues_the_committed_rows():
    from wamrt.eval.planner import ExpertPlanner
    from wamrt.sim import PandaEnv

    with PandaEnv("turntable", render=False) as env:
        obs = _turntable_observation(env)
        planner = ExpertPlanner("turntable")
        naive = planner.infer(obs)["actions"]
        again = planner.infer(obs)["actions"]
        prefix = naive[:6] + np.float32(0.01)  # committed rows the planner did not choose itself
        cont = planner.infer({**obs, PREFIX_KEY: prefix})["actions"]
        before = env.data.qpos.copy()
    np.testing.assert_array_equal(naive, again)  # a plan is a function of the state
    np.testing.assert_array_equal(cont[:6], prefix)  # the reply starts with the prefix, bit for bit
    assert np.abs(cont[6, :7] - prefix[-1, :7]).max() < 0.05  # and continues from where it leaves the arm
    assert np.array_equal(before, env.data.qpos)  # planning never touches the live simulator


def test_expert_planner_can_plan_with_an_assumed_turntable_rate():
    """The what-if behind --expert-turntable-rate: the plan follows the disc at the assumed rate (0: a still disc
    plans differently from the true one), and the live simulator is untouched."""
    from wamrt.eval.planner import ExpertPlanner
    from wamrt.sim import PandaEnv

    with PandaEnv("turntable", render=False) as env:
        obs, true_rate = _turntable_observation(env), env.turntable_rate()
        before = env.data.qvel.copy()
        truth = ExpertPlanner("turntable").infer(obs)["actions"]
        still = ExpertPlanner("turntable", turntable_rate=0.0).infer(obs)["actions"]
        assumed = ExpertPlanner("turntable", turntable_rate=true_rate).infer(obs)["actions"]
        assert np.array_equal(before, env.data.qvel)
        env.set_turntable_rate(0.2)
        assert env.turntable_rate() == pytest.approx(0.2)
    assert 0.35 <= true_rate <= 0.55
    assert np.abs(still - truth).max() > 0.02  # a still disc is planned for differently
    assert np.abs(assumed - truth).max() < np.abs(still - truth).max()  # the right rate plans (about) the truth
    with PandaEnv("pick_place", render=False) as env:
        env.reset(0, render=False)
        with pytest.raises(ValueError, match="no turntable"):
            env.set_turntable_rate(0.4)


def _expert_until(env, seed, done):
    """The closed-loop expert on `env` from `seed` until `done(env, expert)`: the expert, at that state."""
    from wamrt.sim import ScriptedExpert

    env.reset(seed, render=False)
    expert = ScriptedExpert()
    expert.reset(env)
    for _ in range(env.spec.max_steps):
        if done(env, expert):
            return expert
        env.step(expert.act(env), render=False)
    raise AssertionError("the expert never reached the state the test needs")


def _sideways_prefix(expert, offset_xy, rows=6):
    """Committed rows that slide the commanded TCP by offset_xy at its height and heading (a policy's arm that
    arrives off target), gripper as commanded."""
    from wamrt.sim.expert import _rz

    rot = _rz(expert.yaw_cmd) @ expert.base_rot
    q, start, out = expert.q_cmd.copy(), expert.p_cmd.copy(), []
    for k in range(1, rows + 1):
        q = expert.ik.solve(q, start + np.r_[offset_xy, 0.0] * k / rows, rot)
        out.append(np.r_[q, 1.0 if expert.phase in ("lift", "carry", "lower") else 0.0])
    return np.asarray(out, np.float32)


def _planned_tcp_z(planner, rows):
    return np.array([planner.expert.ik.forward(np.asarray(r[:7], np.float64))[0][2] for r in rows])


def test_expert_planner_lowers_a_cube_held_off_the_pads_centre():
    """A held cube 2.5 cm off the pad's centre, partway down: the planner lowers it while recentring (PLACE_TOL
    accepts 5 cm) and places it within the chunk. Until 2026-12-07 it rose back to carry height first (it lowered only
    from within 1 cm), and DAgger labels taught the policy to hover over the pad."""
    from wamrt.eval.planner import SIM_STATE_KEY, ExpertPlanner, snapshot
    from wamrt.sim import PandaEnv
    from wamrt.sim.expert import CARRY_Z

    with PandaEnv("pick_place", render=False) as env:
        expert = _expert_until(env, 3, lambda e, x: x.phase == "lower" and e.tcp_pos()[2] < CARRY_Z - 0.04)
        prefix = _sideways_prefix(expert, np.array([0.025, 0.0]))
        obs = {SIM_STATE_KEY: snapshot(env, 3), PREFIX_KEY: prefix}
        planner = ExpertPlanner("pick_place")
        plan = planner.infer(obs)["actions"]
        placed = planner.env.success()  # the planner's private simulator ran the whole chunk
    held = plan[len(prefix) - 1:]
    held = held[: int(np.argmin(held[:, 7] > 0.5))]  # up to the release (the retreat then rises)
    z = _planned_tcp_z(planner, held)
    assert len(held) > 10 and np.diff(z).max() < 0.002  # never rises while it holds the cube
    assert z[-1] < z[0] - 0.05 and placed


def test_the_experts_own_carry_lowers_from_within_4_cm_of_the_pad_as_its_planner_does():
    """The demos and the planner's labels agree: the expert starts lowering a carried cube once the TCP is within
    LOWER_RESUME_M of the pad's centre (it waited for 1 cm, and a policy that stops 1.5-2.5 cm off hovered), and
    places it."""
    from wamrt.sim import PandaEnv
    from wamrt.sim.expert import LOWER_RESUME_M

    off = []
    with PandaEnv("pick_place", render=False) as env:
        for seed in range(4):
            expert = _expert_until(env, seed, lambda e, x: x.phase == "lower")
            off.append(float(np.linalg.norm(env.tcp_pos()[:2] - env.layout.pad_xy)))
            for _ in range(60):
                env.step(expert.act(env), render=False)
            assert env.success()
    assert max(off) < LOWER_RESUME_M and max(off) > 0.01


def test_expert_planner_reapproaches_a_missed_cube_from_just_above_it():
    """The arm low beside the cube (4 cm off, outside the descent's 3 cm window): the planner clears the cube's top,
    goes over it and grasps within the chunk, where it used to climb back to the 12 cm hover point first."""
    from wamrt.eval.planner import SIM_STATE_KEY, ExpertPlanner, snapshot
    from wamrt.sim import PandaEnv
    from wamrt.sim.expert import REAPPROACH_Z

    with PandaEnv("pick_place", render=False) as env:
        expert = _expert_until(env, 3, lambda e, x: x.phase == "descend"
                               and e.tcp_pos()[2] < e.cube_pos(e.layout.target)[2] + 0.05)
        cube_z = float(env.cube_pos(env.layout.target)[2])
        prefix = _sideways_prefix(expert, np.array([0.0, 0.04]))
        planner = ExpertPlanner("pick_place")
        plan = planner.infer({SIM_STATE_KEY: snapshot(env, 3), PREFIX_KEY: prefix})["actions"]
    free = plan[len(prefix):]
    closes = int(np.argmax(free[:, 7] > 0.5))
    assert free[closes, 7] > 0.5  # it closes on the cube within the chunk
    z = _planned_tcp_z(planner, free[:closes])
    assert z.max() < cube_z + REAPPROACH_Z + 0.01  # having cleared its top, no higher


def test_grid_expert_turntable_rate_is_recorded_and_only_for_the_expert(tmp_path, capsys):
    from wamrt.cli import main

    argv = ["eval", "grid", "--policy", "expert", "--tasks", "turntable", "--delays", "3", "--strategies", "prefix",
            "--episodes", "1", "--workers", "1", "--lanes", "1", "--max-steps", "8", "--out", str(tmp_path),
            "--expert-turntable-rate", "0.45"]
    assert main(argv) == 0
    cell = json.loads((tmp_path / "turntable-d3-prefix.json").read_text())
    assert cell["config"]["expert_turntable_rate"] == 0.45
    assert main(["eval", "grid", "--policy", "tiny-droid", "--out", str(tmp_path), "--expert-turntable-rate", "0"]) == 2
    assert "--expert-turntable-rate is for --policy expert" in capsys.readouterr().err
    assert main(["eval", "grid", "--policy", "expert", "--out", str(tmp_path), "--expert-turntable-rate", "0"]) == 2
    assert "pick_place has no turntable" in capsys.readouterr().err  # the default tasks: pick_place,turntable


def test_grid_of_only_trained_strategies_without_a_trained_policy_is_refused(tmp_path, capsys):
    """Seen on the GPU (945d6c9): with no checkpoint for prefix-trained, a grid of only that strategy planned no
    cells and then failed drawing its empty chart. It is refused up front, naming the flag."""
    from wamrt.cli import main

    argv = ["eval", "grid", "--policy", "tiny-droid", "--tasks", "turntable", "--delays", "0,10", "--strategies",
            "prefix-trained", "--episodes", "1", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "prefix-trained needs --trained-policy" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_grid_runs_cells_shares_d0_and_pairs_them(tmp_path):
    from wamrt.eval.grid import LocalBackend, plan_cells, run_grid
    from wamrt.eval.grid_report import cell_result, write_grid

    cells = plan_cells(["pick_place"], [0, 3], ["sync", "async", "prefix"])
    assert [c.name for c in cells] == ["pick_place-d0", "pick_place-d3-sync", "pick_place-d3-async",
                                       "pick_place-d3-prefix"]
    seeds = [0, 1]
    run = run_grid(cells, seeds, {"base": LocalBackend(WigglePolicy())}, workers=1, lanes=3, max_batch=4,
                   max_steps=18, env_kwargs={"exterior_hw": (32, 56)})  # d = 3: the last requests are still in flight
    assert sorted(run.results) == [0, 1, 2, 3] and all(len(r) == 2 for r in run.results.values())
    assert max(run.batches) > 1  # lanes share policy calls
    sync = run.results[1][0].realtime
    assert sync["stalled"] >= 3 * 2  # waits d = 3 for each of its requests
    assert run.results[2][0].realtime["delays"] == [3] * len(run.results[2][0].realtime["delays"])
    files = {c: cell_result(c, run.results[i], seeds, {}, gpu="cpu", policy_label="wiggle",
                            shared_by=["sync", "async", "prefix"]) for i, c in enumerate(cells)}
    assert run.stage_ms == [] and run.stage_ms_mean() == {}  # a policy without stage timings reports none
    meta = {"policy": "wiggle", "wall_s": run.wall_s, "calls": len(run.batches), "mean_batch": 2.0,
            "batch_ms_mean": 12.34, "stage_ms_mean": {"vae_encode": 3.0, "total": 12.0}, "policy_busy_share": 0.5}
    path, rows = write_grid(tmp_path, cells, files, ["sync", "async", "prefix"], [0, 3], meta)
    assert "12 ms a call (vae_encode 3.0 ms, total 12.0 ms), the policy busy 50 % of the wall" in path.read_text()
    assert (tmp_path / "success-vs-delay.png").stat().st_size > 1000
    cell = json.loads((tmp_path / "pick_place-d3-prefix.json").read_text())
    assert cell["kind"] == "rollout" and cell["delay_steps"] == 3 and cell["strategy"] == "prefix"
    assert cell["realtime"]["stall_fraction"] > 0 and "jerk_boundary_mean" in cell["realtime"]
    prefix_row = next(r for r in rows if r["strategy"] == "prefix")
    assert prefix_row["vs_async"]["episodes"] == 2 and prefix_row["vs_own_d0"]["episodes"] == 2
    assert "| 3 | prefix |" in path.read_text()


def test_grid_batches_every_blocked_workers_requests_together(monkeypatch):
    """At d = 0 every worker blocks on its replies each request tick: the policy process waits until all of them have
    asked (or MERGE_WAIT_S passes) and serves one call, instead of one call per worker as their requests trickle in
    (on the H100 a call cost ~171 ms whatever its size)."""
    from wamrt.eval import grid
    from wamrt.eval.grid import LocalBackend, plan_cells, run_grid

    # A loaded test machine's slow tick is still waited for (0.5 s split a batch under CI load on 2026-12-07); a
    # process that served per worker would still answer [2] * 10, so a long wait keeps the test's teeth.
    monkeypatch.setattr(grid, "MERGE_WAIT_S", 2.0)
    cells = plan_cells(["pick_place"], [0], ["sync"])
    run = run_grid(cells, [0, 1, 2, 3], {"base": LocalBackend(WigglePolicy())}, workers=2, lanes=2, max_batch=8,
                   max_steps=40, env_kwargs={"exterior_hw": (32, 56)})
    assert all(len(r) == 4 for r in run.results.values())
    # both workers' two lanes in one call (the first call may not wait for a worker still starting up, and the
    # episodes' last requests come apart); one call per worker's pair before this: [2] * 10
    assert run.batches.count(4) >= 3 and len(run.batches) <= 7, run.batches


def test_grid_serves_delayed_requests_only_once_a_worker_needs_one():
    """In the delay mode a request is needed d ticks after it is sent: the policy process keeps collecting while no
    worker is blocked, however long it has been quiet (a call served at the first quiet moment split a DAgger
    recording's requests into calls of 6.5 on the H100), and serves once one has waited MERGE_WAIT_S, every live
    one waits, or a batch is full."""
    from wamrt.eval.grid import MERGE_WAIT_S, should_serve

    live, t = {0, 1, 2}, 100.0
    assert not should_serve(5, live, {}, 128, t)  # quiet for any time: nobody needs a reply yet
    assert not should_serve(0, live, {0: t - 10}, 128, t)  # nothing to serve
    assert not should_serve(5, live, {0: t - MERGE_WAIT_S / 2}, 128, t)  # the others' requests may still join
    assert should_serve(5, live, {0: t - 1.5 * MERGE_WAIT_S}, 128, t)
    assert should_serve(5, live, dict.fromkeys(live, t), 128, t)  # everyone waits: nothing more can come
    assert should_serve(128, live, {}, 128, t)  # a full batch


def test_grid_workers_prepare_an_engines_requests(tmp_path, monkeypatch):
    """With an Engine behind a grid policy, the simulator processes validate and compose each request's canvas
    (one core each) and the engine admits them as they are: the same episodes as when the engine's own process
    does that work (the grid's throughput bound on the H200 at 716c9e3). Both at one torch thread: the canvas's
    fp32 bilinear resize with its truncating cast can differ by 1 in a pixel between thread counts."""
    import torch

    from wamrt import load_policy
    from wamrt.engine import Engine, EngineConfig
    from wamrt.eval.grid import LocalBackend, plan_cells, run_grid

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path / "cache"))
    engine = Engine.from_policy(load_policy("tiny-droid", device="cpu"),
                                EngineConfig(attention="auto", compile=False, cuda_graph=False))
    cells = plan_cells(["pick_place"], [2], ["prefix"])
    runs, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prepared in (True, False):
            backend = LocalBackend(engine, steps=1)
            assert backend.host_contract is engine.contract
            if not prepared:
                backend.host_contract = None  # the engine's process composes the canvases
            runs[prepared] = run_grid(cells, [0], {"base": backend}, workers=1, lanes=1, max_batch=2, max_steps=12,
                                      env_kwargs={"exterior_hw": (32, 56)})
    finally:
        torch.set_num_threads(threads)
    a, b = runs[True].results[0][0], runs[False].results[0][0]
    assert a.error is None and a.requests >= 2 and a.realtime["delays"] == [2]
    assert a.realtime == b.realtime and a.trace == b.trace  # the same rows ran: jerk sums, stalls, delays
    # every call's stages come back: where the policy process's time went (the grid's bound on the GPU)
    run = runs[True]
    assert len(run.stage_ms) == len(run.batches) >= 1
    stages = run.stage_ms_mean()
    assert {"vae_encode", "denoise", "total"} <= set(stages), stages
    assert 0 < stages["vae_encode"] < stages["total"] and 0 < stages["denoise"] < stages["total"]
    assert 0 < run.policy_busy_share() < 1
    assert LocalBackend(WigglePolicy()).host_contract is None  # a policy that is no Engine gets observations


def test_grid_seam_strategies_cross_fade_after_the_prefix():
    """`prefix-trained-seam` is `prefix-trained` with SEAM_ROWS rows after the prefix cross-faded from the old plan:
    same requests and delays, and a smaller jerk at the chunk boundaries."""
    from wamrt.eval.grid import SEAM_ROWS, LocalBackend, plan_cells, run_grid

    cells = plan_cells(["pick_place"], [3], ["prefix-trained", "prefix-trained-seam"])
    assert [(c.name, c.seam_rows) for c in cells] == [("pick_place-d3-prefix-trained", None),
                                                      ("pick_place-d3-prefix-trained-seam", SEAM_ROWS)]
    wiggle = LocalBackend(WigglePolicy())
    run = run_grid(cells, [0], {"base": wiggle, "trained": wiggle}, workers=1, lanes=2, max_batch=4, max_steps=18,
                   env_kwargs={"exterior_hw": (32, 56)})
    plain, seam = run.results[0][0].realtime, run.results[1][0].realtime
    assert plain["delays"] == seam["delays"] == [3] * len(plain["delays"]) and len(plain["delays"]) >= 2
    assert seam["boundary_max"] < plain["boundary_max"] / 2  # the wiggle's jump at the switch is spread out


def test_grid_refuses_unknown_strategies():
    from wamrt.eval.grid import plan_cells

    with pytest.raises(ValueError, match="ensemble"):
        plan_cells(["pick_place"], [0], ["ensemble"])


def test_grid_command_loads_one_engine_when_both_policies_are_one_checkpoint(tmp_path, monkeypatch):
    """The turntable grid names the prefix-trained checkpoint as both policies: one engine, and one d = 0 run whose
    result stands for both d = 0 cells."""
    from wamrt.cli import main
    from wamrt.cli import realtime as cli_realtime

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path / "cache"))
    loads = []
    real_backend = cli_realtime._backend
    monkeypatch.setattr(cli_realtime, "_backend", lambda name, args: loads.append(name) or real_backend(name, args))
    out = tmp_path / "grid"
    assert main(["eval", "grid", "--policy", "tiny-droid", "--trained-policy", "tiny-droid", "--tasks", "pick_place",
                 "--delays", "0", "--strategies", "async,prefix-trained", "--episodes", "1", "--workers", "1",
                 "--lanes", "2", "--max-batch", "2", "--max-steps", "9", "--steps", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    assert loads == ["tiny-droid"]
    base, trained = (json.loads((out / f"pick_place-d0{s}.json").read_text()) for s in ("", "-trained"))
    assert base["outcomes"] == trained["outcomes"] and base["realtime"] == trained["realtime"]
    assert trained["policy_role"] == "trained" and trained["copy_of"] == "pick_place-d0.json"
    assert (trained["cell"], trained["shared_by"], base["shared_by"]) == ("pick_place-d0-trained", ["prefix-trained"],
                                                                          ["async"])
    from wamrt.eval.grid_report import load_cells

    assert {(c.delay, c.strategy) for c in load_cells(out)} == {(0, "async"), (0, "prefix-trained")}
    stale = {**trained, "cell": "pick_place-d0", "shared_by": ["async"]}  # a copy as written before the fix
    (out / "pick_place-d0-trained.json").write_text(json.dumps(stale))
    assert {(c.delay, c.strategy) for c in load_cells(out)} == {(0, "async"), (0, "prefix-trained")}
    assert trained["config"]["trained"]["model"] == "tiny-droid"
    summary = json.loads((out / "summary.json").read_text())
    assert sum(int(b) * n for b, n in summary["batch_hist"].items()) == base["realtime"]["requests"]  # run once
    assert {"vae_encode", "denoise", "total"} <= set(summary["stage_ms_mean"]) and summary["policy_busy_share"] > 0


def test_grid_command_resumes_and_rebuilds_its_report(tmp_path, capsys):
    from wamrt.cli import main

    argv = ["eval", "grid", "--policy", "expert", "--tasks", "turntable", "--delays", "0,3", "--strategies",
            "async,prefix", "--episodes", "2", "--workers", "1", "--lanes", "2", "--max-steps", "10",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    first = {p.name: p.read_text() for p in tmp_path.glob("turntable-*.json")}
    assert sorted(first) == ["turntable-d0.json", "turntable-d3-async.json", "turntable-d3-prefix.json"]
    (tmp_path / "turntable-d3-prefix.json").unlink()  # as if the first call ran out of time before this cell
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "grid: 1 cells" in capsys.readouterr().err  # only the missing cell ran
    assert (tmp_path / "turntable-d0.json").read_text() == first["turntable-d0.json"]  # kept, not rewritten
    assert json.loads((tmp_path / "turntable-d3-prefix.json").read_text())["outcomes"] == json.loads(
        first["turntable-d3-prefix.json"])["outcomes"]  # the expert planner replays
    (tmp_path / "summary.md").unlink()
    assert main([*argv, "--report-only"]) == 0
    assert "| 3 | prefix |" in (tmp_path / "summary.md").read_text()
    # Another strategy list names the shared d = 0 cell after its own first strategy: still the same episodes, kept.
    capsys.readouterr()
    wider = [*argv[:argv.index("--strategies") + 1], "sync,async,prefix", *argv[argv.index("--strategies") + 2:]]
    assert main([*wider, "--resume"]) == 0
    assert "grid: 1 cells" in capsys.readouterr().err  # d = 3 sync only
    assert (tmp_path / "turntable-d0.json").read_text() == first["turntable-d0.json"]


def test_grid_sampling_overrides_reach_the_policy_and_never_a_server(tmp_path, monkeypatch):
    """--steps and --guidance-interval (the levers 2 steps and guidance on the first step only) are applied to every
    call of an in-process policy; a server URL, whose requests would not carry them, is refused in one line."""
    from wamrt.cli import build_parser, main
    from wamrt.cli import realtime as cli_realtime

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path / "cache"))
    args = build_parser().parse_args(["eval", "grid", "--policy", "tiny-droid", "--out", str(tmp_path), "--steps",
                                      "2", "--guidance-interval", "833", "1000", "--device", "cpu"])
    backend, _, config = cli_realtime._backend("tiny-droid", args)
    assert backend.overrides == {"steps": 2, "guidance_interval": (833, 1000)}
    assert config["guidance_interval"] == (833, 1000)
    with pytest.raises(ValueError, match="in-process"):
        cli_realtime._backend("ws://127.0.0.1:9", args)
    for bad in (["833-1000"], ["first", "1000"]):  # the syntax of every other command's --guidance-interval
        with pytest.raises(SystemExit):
            build_parser().parse_args(["eval", "grid", "--policy", "x", "--out", "y", "--guidance-interval", *bad])
    assert main(["eval", "grid", "--policy", "tiny-droid", "--out", str(tmp_path), "--guidance-interval", "1000",
                 "937"]) != 0
    assert main(["eval", "grid", "--policy", "ws://127.0.0.1:9", "--out", str(tmp_path), "--steps", "2"]) != 0


def test_grid_records_a_quantized_checkpoints_recipe(tmp_path, monkeypatch):
    """The gen-fp8 lever runs in the grid's own engine from a `wamrt quantize` artifact; its cells say so."""
    from wamrt.cli import build_parser, main
    from wamrt.cli import realtime as cli_realtime

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path / "cache"))
    q = tmp_path / "fp8"
    assert main(["quantize", "--model", "tiny-droid", "--recipe", "gen-fp8", "--out", str(q)]) == 0
    args = build_parser().parse_args(["eval", "grid", "--policy", str(q), "--out", str(tmp_path), "--steps", "2",
                                      "--device", "cpu"])
    backend, _, config = cli_realtime._backend(str(q), args)
    assert config["quantization"] == "gen-fp8" and config["steps"] == 2
    assert backend.overrides == {"steps": 2}  # the recipe is the checkpoint's, not a sampling override
    _, _, plain = cli_realtime._backend("tiny-droid", args)
    assert "quantization" not in plain


# ---- on-policy training data (eval/dagger.py) ----------------------------------------------------------------
def test_a_recorded_request_holds_its_canvas_state_prefix_and_the_experts_continuation(tmp_path):
    """Each request of a delayed episode is kept with the canvas the policy saw, its state row, and the expert
    planner's chunk for it: the request's own prefix, then the expert's rows from where that prefix leaves the arm."""
    from wamrt.client.clocks import SimClock
    from wamrt.client.realtime import GRIPPER_KEY, DelayEstimator, RealtimeRunner
    from wamrt.eval.dagger import DaggerEpisode
    from wamrt.eval.planner import ExpertPlanner
    from wamrt.eval.realtime import LaneEpisode
    from wamrt.pipeline.droid import DroidContract, droid_host_inputs
    from wamrt.pipeline.noise import droid_state_row
    from wamrt.sim.env import PandaEnv
    from wamrt.train.data import policy_canvas

    with PandaEnv("pick_place", exterior_hw=(32, 56)) as env:
        runner = RealtimeRunner(WigglePolicy(), strategy="prefix", clock=SimClock(3), prefix_mode="clean",
                                estimator=DelayEstimator(initial=3))
        ep = LaneEpisode(env, runner, seed=5, max_steps=30)
        planner = ExpertPlanner("pick_place")
        record = DaggerEpisode("pick_place", 3, 5, "256", planner)
        sent = []
        contract = DroidContract(tier="256")
        while not ep.done:
            request = ep.begin()
            if request is not None:
                # every other request with the canvas an engine's host inputs hold, as the grid passes it
                padded = droid_host_inputs(request.obs, contract).padded if len(sent) % 2 else None
                record.add(env, request.obs, padded)
                sent.append(request.obs)
                runner.dispatch(request)
            ep.end()
        path = record.write(tmp_path, ep.success)
    assert path is not None and path.name == "dagger-pick_place-d03-0000005.npz"
    with np.load(path) as z:
        chunk, prefix_rows, canvas, state = z["chunk"], z["prefix_rows"], z["canvas"], z["state"]
        assert z["grasp_unseen"].dtype == bool and z["grasp_unseen"].shape == (len(sent),)
        assert z["actions"].shape == (len(sent), 8) and np.array_equal(z["actions"], chunk[:, 0])
    assert chunk.shape == (len(sent), 32, 8) and len(sent) >= 3
    assert prefix_rows[0] == 0 and all(p == 3 for p in prefix_rows[1:])  # the first request has nothing committed
    for t, obs in enumerate(sent):
        assert np.array_equal(canvas[t], policy_canvas(obs, "256")[0])
        assert np.array_equal(state[t], droid_state_row(obs[JOINT_KEY], obs[GRIPPER_KEY]))
        p = int(prefix_rows[t])
        if p:
            assert np.array_equal(chunk[t, :p], np.asarray(obs[PREFIX_KEY], np.float32))
        # the expert continues from the prefix's end, at the arm's speed (never the wiggle's rows)
        assert np.abs(np.diff(chunk[t, max(p - 1, 0):, :7], axis=0)).max() < 0.2
        assert not np.allclose(chunk[t, p:p + 4], WigglePolicy().infer(obs, 0).actions[p:p + 4], atol=1e-3)


def test_grasp_unseen_marks_a_label_that_opens_for_a_miss_the_request_could_not_see():
    """The mark needs all four: a prefix ending closed, a label opening after it, the cube not held and the fingers
    not shut at the request's step."""
    from types import SimpleNamespace

    from wamrt.eval.dagger import FINGERS_SHUT, grasp_unseen

    def env(held=False, closure=0.2):
        return SimpleNamespace(layout=SimpleNamespace(target=0), cube_held=lambda i: held,
                               gripper_position=lambda: closure)

    closed, opened = np.ones((4, 8), np.float32), np.zeros((4, 8), np.float32)
    label = np.ones((32, 8), np.float32)
    label[10:, 7] = 0.0  # the expert lets go six rows after the prefix
    keeps = np.ones((32, 8), np.float32)
    assert grasp_unseen(env(), closed, label)
    assert not grasp_unseen(env(), closed, keeps)  # the grasp holds: the label keeps closing
    assert not grasp_unseen(env(), opened, label)  # nothing committed closing
    assert not grasp_unseen(env(), np.zeros((0, 8), np.float32), label)  # no prefix
    assert not grasp_unseen(env(held=True), closed, label)  # carrying: opening is the place, in view
    assert not grasp_unseen(env(closure=FINGERS_SHUT), closed, label)  # the miss is in view: fingers shut on nothing
    assert grasp_unseen(env(closure=0.375), closed, label)  # fingers on the cube, not yet lifted


def test_cube_held_is_true_in_the_experts_lift_and_false_on_the_table():
    from wamrt.sim.env import PandaEnv
    from wamrt.sim.expert import ScriptedExpert

    with PandaEnv("lift", render=False) as env:
        env.reset(3, render=False)
        expert = ScriptedExpert()
        expert.reset(env)
        held = []
        for _ in range(120):
            env.step(expert.act(env), render=False)
            held.append(env.cube_held(env.layout.target))
        assert not held[0] and held[-1] and env.success()


def test_grid_records_one_file_per_episode_with_the_runners_prefixes(tmp_path):
    from wamrt.eval.dagger import dagger_gap
    from wamrt.eval.grid import LocalBackend, plan_cells, run_grid
    from wamrt.train.data import load_demo_dirs

    cells = plan_cells(["pick_place"], [3], ["prefix"])
    run = run_grid(cells, [0, 1], {"base": LocalBackend(WigglePolicy())}, workers=1, lanes=2, max_batch=4,
                   max_steps=20, env_kwargs={"exterior_hw": (32, 56)}, record={"dir": str(tmp_path), "tier": "256"})
    files = sorted(tmp_path.glob("dagger-*.npz"))
    assert [f.name for f in files] == ["dagger-pick_place-d03-0000000.npz", "dagger-pick_place-d03-0000001.npz"]
    for f, result in zip(files, run.results[0], strict=True):
        with np.load(f) as z:
            assert len(z["chunk"]) == result.requests
            assert z["prefix_rows"].tolist() == result.realtime["prefix_rows"]
            # the policy's reply beside the label: the wiggle answers every request that arrived with the prefix
            # as its first rows; the last requests of an episode may still be in flight (NaN)
            answered = ~np.isnan(z["reply"]).any(axis=(1, 2))
            assert answered.sum() >= len(result.realtime["delays"]) >= 2
            for reply, chunk, p in zip(z["reply"][answered], z["chunk"][answered], z["prefix_rows"][answered],
                                       strict=True):
                assert np.array_equal(reply[:p], chunk[:p])
    gap = dagger_gap(files)
    assert list(gap) == [3] and gap[3]["requests"] >= 4 and gap[3]["mean_rad"] > 0.01
    ds = load_demo_dirs([tmp_path])
    assert ds.chunks is not None and ds.chunk_row is not None and ds.fixed_prefix is not None
    assert ds.chunk_row.tolist() == list(range(len(ds))) and ds.fixed_prefix.max() == 3


def test_the_planner_module_imports_first_in_a_fresh_process():
    """eval/planner.py is importable before anything else of the simulator (it once imported mujoco before wamrt.sim
    chose the GL backend, which then refused to)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    done = subprocess.run([sys.executable, "-c", "import wamrt.eval.planner, wamrt.eval.dagger"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-800:]
