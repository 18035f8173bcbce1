"""The whole quality path on a CPU, tiny: record expert demos -> train a few steps -> serve the checkpoint
-> roll it out over the websocket. CI keeps this path alive; the GPU run (scripts/gpu_pipeline.sh) is the
same commands at full size."""

from __future__ import annotations

import argparse
import json


def _cli(argv: list[str]) -> int:
    from wamrt.cli.sim import add_subcommands as sim_commands
    from wamrt.cli.train import add_subcommands as train_commands

    ap = argparse.ArgumentParser(prog="wamrt")
    sub = ap.add_subparsers(dest="command", required=True)
    sim_commands(sub)
    train_commands(sub)
    args = ap.parse_args(argv)
    return args.func(args)


def test_record_train_serve_rollout(tmp_path):
    import wamrt
    from wamrt.serving import ServeConfig, ServerThread

    demos, ckpt, out = tmp_path / "demos", tmp_path / "ckpt", tmp_path / "rollout.json"
    assert _cli(["train", "record", "--task", "pick_place", "--episodes", "2", "--out", str(demos)]) == 0
    assert _cli(["train", "fit", "--demos", str(demos), "--out", str(ckpt), "--size", "tiny-qwen", "--batch", "2",
                 "--max-steps", "3", "--minutes", "5", "--aug-shift", "0", "--aug-colour", "0", "--log-every", "1",
                 "--val-episodes", "1"]) == 0
    meta = json.loads((ckpt / "wamrt.json").read_text())
    assert meta["train"]["steps"] == 3 and "action_normalization" in meta and "git_sha" in meta["provenance"]
    policy = wamrt.load_policy(ckpt, device="cpu")
    with ServerThread(policy, ServeConfig(max_batch=2, max_wait_ms=5.0)) as srv:
        rc = _cli(["rollout", "--url", srv.ws_url, "--task", "pick_place", "--episodes", "2", "--lanes", "2",
                   "--max-steps", "16", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["episodes"] == 2 and res["summary"]["errors"] == 0
    assert res["config"]["server"]["action_normalization"].startswith("per-row")
