import argparse
import json
import subprocess
import sys

import pytest

import wamrt
from wamrt.cli.sim import PolicySpec, UsageError, add_subcommands, parse_spec


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="wamrt")
    sub = ap.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = ap.parse_args(argv)
    return args.func(args)


def test_rollout_expert_writes_result(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    rc = _run(["rollout", "--task", "lift", "--policy", "expert", "--episodes", "2", "--lanes", "1",
               "--seed0", "0", "--execute-steps", "8", "--out", str(out), "--progress", "on"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "2/2 = 100.0% (Wilson 95% CI" in captured.out
    # the forced progress bar (stderr is no terminal here): episodes done, running success rate, ETA
    assert "2/2" in captured.err and "success 1/1 = 100%" in captured.err and "success 2/2 = 100%" in captured.err
    assert "<" in captured.err  # tqdm's "elapsed<remaining"
    res = json.loads(out.read_text())
    for key in ("kind", "git_sha", "command", "date", "gpu", "torch", "task", "policy", "episodes", "successes",
                "success_rate", "ci95", "seeds", "config"):
        assert key in res
    assert res["kind"] == "rollout" and res["policy"] == "expert" and res["successes"] == 2
    assert res["seeds"] == {"first": 0, "last": 1} and res["outcomes"] == [1, 1]


def test_gate_expert_vs_expert(tmp_path, capsys):
    out = tmp_path / "gate.json"
    rc = _run(["eval", "gate", "--task", "lift", "--baseline", "expert", "--candidate", "expert",
               "--episodes", "2", "--seed0", "3", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "success" not in captured.err  # --progress auto: no bar when stderr is no terminal
    assert "p = 1" in text and "verdict: inconclusive" in text  # 2 identical episodes bound nothing
    res = json.loads(out.read_text())
    assert res["kind"] == "gate" and "verdict" in res and res["p_value"] == 1.0
    assert res["baseline_successes"] == res["candidate_successes"] == 2 and res["seeds"] == {"first": 3, "last": 4}
    # --require-pass turns a non-pass verdict into exit code 1 for scripts
    assert _run(["eval", "gate", "--task", "lift", "--baseline", "expert", "--candidate", "expert",
                 "--episodes", "1", "--require-pass"]) == 1


def test_bad_arguments_exit_2(capsys):
    assert _run(["rollout", "--task", "nope", "--episodes", "2"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert _run(["eval", "gate", "--task", "lift", "--baseline", "tiny-droid:stepz=2",
                 "--candidate", "expert"]) == 2
    assert "bad SPEC item 'stepz=2'" in capsys.readouterr().err
    assert _run(["rollout", "--task", "lift", "--steps", "2"]) == 2  # sampling options need a model
    assert "do not apply to the expert" in capsys.readouterr().err


def test_parse_spec():
    assert parse_spec("tiny-droid") == PolicySpec("tiny-droid")
    assert parse_spec("tiny-droid:steps=2,guidance=3,guidance_interval=1-3,execute_steps=16") == PolicySpec(
        "tiny-droid", {"steps": 2, "guidance": 3.0, "guidance_interval": (1, 3)}, 16)
    assert parse_spec("/ckpt/run:7") == PolicySpec("/ckpt/run:7")  # no '=': part of the folder name
    for bad in ("tiny-droid:steps=x", "expert:steps=2", "tiny-droid:execute_steps=0"):
        with pytest.raises(UsageError):
            parse_spec(bad)


def test_demos_record_and_lerobot_export(tmp_path, capsys):
    pytest.importorskip("av")
    demos, ds = tmp_path / "demos", tmp_path / "ds"
    assert _run(["demos", "record", "--task", "lift", "--episodes", "1", "--out", str(demos),
                 "--exterior-hw", "64", "96"]) == 0
    assert (demos / "episode_000000.npz").is_file() and (demos / "manifest.json").is_file()
    assert _run(["export", "lerobot", "--demos", str(demos), "--out", str(ds)]) == 0
    assert json.loads((ds / "meta/info.json").read_text())["total_episodes"] == 1
    assert _run(["export", "lerobot", "--demos", str(demos), "--out", str(ds)]) == 2  # never overwrites unasked
    assert "already holds a dataset (pass --force to replace it)" in capsys.readouterr().err
    (ds / "stale.txt").write_text("from the earlier export")
    assert _run(["export", "lerobot", "--demos", str(demos), "--out", str(ds), "--force"]) == 0
    assert not (ds / "stale.txt").exists() and json.loads((ds / "meta/info.json").read_text())["total_episodes"] == 1


def test_missing_sim_extra_is_a_clear_error(monkeypatch, capsys):
    # Simulate an install without mujoco: the import of wamrt.sim fails.
    monkeypatch.setitem(sys.modules, "wamrt.sim", None)
    monkeypatch.delattr(wamrt, "sim")
    assert _run(["rollout", "--task", "lift", "--episodes", "1"]) == 2
    assert "needs the 'sim' extra" in capsys.readouterr().err


def test_building_the_parser_does_not_import_mujoco():
    code = ("import argparse, sys; from wamrt.cli.sim import add_subcommands; "
            "add_subcommands(argparse.ArgumentParser().add_subparsers()); "
            "print(sorted(m for m in ('mujoco', 'torch', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_rollout_against_a_server_over_websocket_lanes(tmp_path, capsys):
    """`wamrt rollout --url`: process lanes are concurrent openpi websocket clients of one server; each
    request carries the episode's request seed and the sampling override, and the result says 'remote'."""
    from oracle.fake_policy import FakePolicy

    from wamrt.eval.agents import request_seed
    from wamrt.serving import ServeConfig, ServerThread

    class Recording(FakePolicy):
        def __init__(self) -> None:
            super().__init__(delay=0.05)
            self.seen: list[tuple[int | None, dict]] = []

        def infer_batch(self, observations, *, seeds=None, **overrides):
            self.seen += [(s, dict(overrides)) for s in (seeds or [None] * len(observations))]
            return super().infer_batch(observations, seeds=seeds, **overrides)

    policy = Recording()
    out = tmp_path / "rollout.json"
    with ServerThread(policy, ServeConfig(max_batch=4, max_wait_ms=20.0)) as srv:
        policy.seen.clear()  # warm-up requests
        rc = _run(["rollout", "--task", "lift", "--url", srv.ws_url, "--episodes", "2", "--lanes", "2",
                   "--seed0", "5", "--max-steps", "16", "--steps", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["agent"] == "remote" and res["config"]["url"] == srv.ws_url
    # the result names what the server served, from its own metadata, and what the requests overrode
    assert "error" not in res["config"]["server"] and res["config"]["server"]["max_batch"] == 4
    assert res["config"]["effective"]["steps"] == 2
    assert res["episodes"] == 2 and res["summary"]["errors"] == 0
    want = {request_seed(ep, k) for ep in (5, 6) for k in (0, 1)}  # 16 steps / 8 executed = 2 requests
    assert {s for s, _ in policy.seen} == want
    assert all(o.get("steps") == 2 for _, o in policy.seen)


def test_gate_reuses_a_recorded_baseline_and_checks_its_seeds(tmp_path, capsys):
    """One baseline rollout file pairs with several candidates; a file of other seeds or another task is refused."""
    base = tmp_path / "base.json"
    assert _run(["rollout", "--task", "lift", "--policy", "expert", "--episodes", "2", "--seed0", "3",
                 "--out", str(base)]) == 0
    rec = json.loads(base.read_text())
    rec["outcomes"] = [1, 0]  # pretend the baseline failed seed 4: the gate must read this, not re-run it
    base.write_text(json.dumps(rec))
    out = tmp_path / "gate.json"
    assert _run(["eval", "gate", "--task", "lift", "--baseline", str(base), "--candidate", "expert",
                 "--episodes", "2", "--seed0", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["baseline_successes"] == 1 and res["candidate_successes"] == 2
    capsys.readouterr()
    assert _run(["eval", "gate", "--task", "lift", "--baseline", str(base), "--candidate", "expert",
                 "--episodes", "2", "--seed0", "4"]) == 2
    assert "seeds" in capsys.readouterr().err
    assert _run(["eval", "gate", "--task", "pick_place", "--baseline", str(base), "--candidate", "expert",
                 "--episodes", "2", "--seed0", "3"]) == 2


def test_delay_mode_rollout_and_a_gate_at_another_delay(tmp_path, capsys):
    base = tmp_path / "base.json"
    assert _run(["rollout", "--task", "turntable", "--episodes", "2", "--strategy", "prefix", "--delay-steps", "3",
                 "--max-steps", "30", "--out", str(base)]) == 0
    assert "delay mode:" in capsys.readouterr().out
    res = json.loads(base.read_text())
    assert (res["strategy"], res["delay_steps"], res["clock"], res["prefix_mode"]) == ("prefix", 3, "simulated", "auto")
    assert res["config"]["agent"] == "expert-planner" and res["realtime"]["delay_steps_mean"] == 3.0
    gate = tmp_path / "gate.json"
    assert _run(["eval", "gate", "--task", "turntable", "--episodes", "2", "--baseline", str(base),
                 "--candidate", "expert:delay_steps=6,strategy=async", "--max-steps", "30", "--out", str(gate)]) == 0
    out = json.loads(gate.read_text())
    assert out["delay_steps"] == {"baseline": 3, "candidate": 6}
    assert out["realtime"]["candidate"]["strategy"] == "async"
    assert _run(["rollout", "--task", "lift", "--latency-ms", "fast"]) == 2
    assert "latency must be" in capsys.readouterr().err
    assert _run(["rollout", "--task", "lift", "--delay-steps", "2", "--latency-ms", "100"]) == 2
    assert _run(["rollout", "--task", "lift", "--wall-clock"]) == 2
    assert "--url" in capsys.readouterr().err


def test_wall_clock_rollout_against_a_server_with_added_latency(tmp_path, capsys):
    """`--wall-clock`: the 15 Hz runner against a real server; d comes from the measured latency."""
    from oracle.fake_policy import FakePolicy

    from wamrt.serving import ServeConfig, ServerThread

    out = tmp_path / "wall.json"
    with ServerThread(FakePolicy(), ServeConfig(max_batch=2, added_latency_ms=150.0)) as srv:
        assert _run(["rollout", "--task", "pick_place", "--url", srv.ws_url, "--wall-clock", "--strategy", "prefix",
                     "--episodes", "1", "--max-steps", "30", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["clock"] == "wall" and res["strategy"] == "prefix" and "delay_steps" not in res
    rt = res["realtime"]
    assert rt["latency_ms_p50"] >= 150 and 3 <= rt["delay_steps_mean"] <= 8 and rt["requests"] >= 2
    assert rt["control_steps"] == 30 and rt["stalled_steps"] <= rt["delay_steps_max"]  # only the first wait
