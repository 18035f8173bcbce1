"""Per-step timeline of panda-droid-rt episodes in the delay mode (CPU diagnosis, not committed)."""
import json, sys, time
import numpy as np
import torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings, LaneEpisode
from wamrt.client.clocks import LatencyModel

task, d, seeds, out = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
policy_name = sys.argv[5] if len(sys.argv) > 5 else "panda-droid-rt"
torch.set_num_threads(1)
policy = load_policy(policy_name, device="cpu")
strategy = "prefix" if d > 0 else "async"
agent = RealtimeAgent(policy, RealtimeSettings(strategy=strategy, latency=LatencyModel(steps=d), prefix_mode="clean"))
rows = []
with PandaEnv(task, render=True) as env:
    for seed in seeds:
        t0 = time.time()
        ep = LaneEpisode(env, agent.runner, seed)
        tgt = env.layout.target
        tl = []
        while not ep.done:
            req = ep.begin()
            if req is not None:
                agent.runner.dispatch(req)
            agent.clock.flush()
            ep.end()
            c = env.cube_pos(tgt)
            tl.append([float(x) for x in (*env.tcp_pos(), *c, env.gripper_position(), float(env.touches_gripper(tgt)))])
        r = ep.result()
        rows.append({"seed": seed, "success": r.success, "steps": r.steps, "stage": r.stage,
                     "pad": [float(x) for x in env.layout.pad_xy], "timeline": tl,
                     "delays": list(agent.runner.log.delays)})
        print(seed, r.success, r.steps, r.stage, f"{time.time()-t0:.0f}s", flush=True)
json.dump({"task": task, "d": d, "policy": policy_name, "episodes": rows}, open(out, "w"))
