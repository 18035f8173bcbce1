"""`wamrt demo`: serve a policy (default: the embedded trained `panda-droid`) with `wamrt serve` and run closed-loop
simulator episodes against it through the real openpi websocket protocol; prints the success rate and latency and
writes an mp4 of the first episode."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..net import free_port

if TYPE_CHECKING:
    import numpy as np


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("demo", help="serve the embedded policy and run closed-loop sim episodes over websocket")
    ap.add_argument("--model", default="panda-droid",
                    help="what the server serves: the embedded trained policy, a built-in name or a checkpoint folder")
    ap.add_argument("--task", default="pick_place", help="lift, pick_place or pick_place_two")
    ap.add_argument("--episodes", type=int, default=3, help="closed-loop episodes, one per seed")
    ap.add_argument("--seed0", type=int, default=0, help="episode seeds are seed0 .. seed0+episodes-1")
    ap.add_argument("--execute-steps", type=int, default=8, help="chunk rows run per inference")
    ap.add_argument("--max-steps", type=int, help="episode step limit (default: the task's)")
    ap.add_argument("--video", type=Path, default=Path("wamrt-demo.mp4"), help="mp4 of the first episode")
    ap.add_argument("--port", type=int, default=0,
                    help="port of the server it starts (0: any free port); the demo talks to it over loopback")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--engine", choices=["auto", "eager", "fast"], default="auto",
                    help="the server's engine (auto: the fast engine on CUDA, the eager path on CPU)")
    ap.set_defaults(func=run)


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def _write_mp4(frames: list[np.ndarray], path: Path, fps: int = 15) -> None:
    import av
    import numpy as np

    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w - w % 2, h - h % 2, "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f[: h - h % 2, : w - w % 2]),
                                                               format="rgb24")))
        out.mux(stream.encode())


def run(args: argparse.Namespace) -> int:
    try:
        from .. import sim  # noqa: F401
    except (ImportError, RuntimeError) as e:
        print(f"error: the simulator is unavailable: {e}", file=sys.stderr)
        return 2
    from ..eval.agents import PolicyAgent
    from ..eval.remote import RemotePolicy
    from ..eval.runner import run_episode, summarize
    from ..eval.stats import wilson_ci
    from ..pipeline.errors import RequestError
    from ..pipeline.policy import TRAINED_MODELS, trained_path
    from ..sim.env import PandaEnv

    if args.model in TRAINED_MODELS:  # say so here, not as a server that dies during start-up
        try:
            trained_path(args.model)
        except RequestError as e:
            print(f"error: {e}\n"
                  f"  --model tiny-droid runs the same loop on an untrained policy (random weights: it moves the "
                  f"arm, it does not succeed); --model DIR serves a checkpoint folder", file=sys.stderr)
            return 2

    port = args.port or free_port()
    cmd = [sys.executable, "-m", "wamrt.cli", "serve", "--model", args.model, "--port", str(port),
           "--engine", args.engine, "--max-batch", "1"] + (["--device", args.device] if args.device else [])
    print(f"serving {args.model}: {' '.join(cmd[1:])}", flush=True)
    # The simulator renders in this process while the server infers: on a small CPU, leave it a core
    # (two torch threads on two busy cores measured ~10x slower than one).
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    # The server's log goes to a file: an unread pipe would block the server once it filled.
    log_file = tempfile.NamedTemporaryFile("w+", prefix="wamrt-demo-server-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        try:
            _wait_ready(port, server)
        except (RuntimeError, TimeoutError) as e:
            log_file.flush()
            print(Path(log_file.name).read_text()[-4000:], file=sys.stderr)
            print(f"error: {e} (its log is above)", file=sys.stderr)
            return 1
        url = f"ws://127.0.0.1:{port}"
        agent = PolicyAgent(RemotePolicy(url), execute_steps=args.execute_steps)
        results = []
        with PandaEnv(args.task) as env:
            for i in range(args.episodes):
                seed = args.seed0 + i
                if i == 0:
                    frames: list[np.ndarray] = []
                    orig_step = env.step

                    def step(action: np.ndarray, *, render: bool = True, _orig=orig_step) -> Any:
                        obs = _orig(action, render=True)
                        frames.append(obs.images["front"])
                        return obs

                    env.step = step  # type: ignore[method-assign]
                    r = run_episode(env, agent, seed, args.max_steps)
                    env.step = orig_step  # type: ignore[method-assign]
                    if frames:
                        _write_mp4(frames, args.video)
                else:
                    r = run_episode(env, agent, seed, args.max_steps)
                results.append(r)
                print(f"episode {i} (seed {seed}): {'success' if r.success else 'failure'} in {r.steps} steps, "
                      f"{r.requests} requests{', error: ' + r.error.splitlines()[-1] if r.error else ''}", flush=True)
        s = summarize(results)
        lo, hi = wilson_ci(s["successes"], s["episodes"])
        print(json.dumps({**s, "success_ci95": [lo, hi], "video": str(args.video)}))
        print(f"{args.task}: {s['successes']}/{s['episodes']} successes; websocket round trip p50 "
              f"{s['infer_p50_ms']:.0f} ms; video {args.video}")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log_file.close()
        Path(log_file.name).unlink(missing_ok=True)
