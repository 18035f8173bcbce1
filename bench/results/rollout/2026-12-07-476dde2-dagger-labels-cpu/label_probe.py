"""Issue 41, CPU: the expert planner's DAgger labels on a delayed policy's own requests, with the resume rules before
and after 476dde2. Runs a checkpoint in the delay mode (prefix, clean, d fixed) and, at every request that carries a
prefix, plans the expert's chunk twice from the same simulator state and prefix: with the old rules (lower only from
within 1 cm of the pad; a low approach climbs to the 12 cm hover point) and the new ones (4 cm; over the cube at
6 cm). For each label: how far the commanded TCP rises over the rows after the prefix before the gripper command
changes (a back-off: no grasp or release in between), and the resumed phase.
Usage: python label_probe.py TASK D SEEDS OUT.json [CHECKPOINT]"""
import json, sys
import numpy as np, torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.sim import expert as expert_mod
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings, LaneEpisode
from wamrt.eval.planner import snapshot, ExpertPlanner, SIM_STATE_KEY
from wamrt.client.clocks import LatencyModel

task, d, seeds, out = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
name = sys.argv[5] if len(sys.argv) > 5 else "panda-droid-rt"
torch.set_num_threads(1)
policy = load_policy(name, device="cpu")
RULES = {"old": (0.01, expert_mod.HOVER), "new": (expert_mod.LOWER_RESUME_M, expert_mod.REAPPROACH_Z)}
planner = ExpertPlanner(task)

def label(obs, snap, rules):
    expert_mod.LOWER_RESUME_M, expert_mod.REAPPROACH_Z = rules
    try:
        rows = planner.infer({**obs, SIM_STATE_KEY: snap})["actions"]
        phase = planner.expert.phase
    finally:
        expert_mod.LOWER_RESUME_M, expert_mod.REAPPROACH_Z = RULES["new"]
    k = len(obs["action_prefix"])
    free = rows[k - 1:]
    same = free[:, 7] > 0.5
    n = int(np.argmax(same != same[0])) or len(free)  # rows before the gripper command changes
    z = np.array([planner.expert.ik.forward(np.asarray(r[:7], np.float64))[0][2] for r in free[:n]])
    return float(z.max() - z[0]), n

records = []
for seed in seeds:
    env = PandaEnv(task, render=True)
    captured = []
    orig = policy.infer
    def infer(obs, *a, **k):
        captured.append((dict(obs), snapshot(env, seed)))
        return orig(obs, *a, **k)
    policy.infer = infer
    agent = RealtimeAgent(policy, RealtimeSettings(strategy="prefix", latency=LatencyModel(steps=d), prefix_mode="clean"))
    ep = LaneEpisode(env, agent.runner, seed)
    while not ep.done:
        req = ep.begin()
        if req is not None:
            agent.runner.dispatch(req)
        agent.clock.flush()
        ep.end()
    policy.infer = orig
    for obs, snap in captured:
        if "action_prefix" not in obs:
            continue
        row = {"seed": seed, "step": snap.step}
        for r, rules in RULES.items():
            row[r + "_rise_m"], row[r + "_rows"] = label(obs, snap, rules)
        records.append(row)
    print(seed, ep.success, ep.steps, len(captured), flush=True)
    env.close()
old = np.array([r["old_rise_m"] for r in records]); new = np.array([r["new_rise_m"] for r in records])
summary = {"task": task, "d": d, "checkpoint": name, "seeds": seeds, "requests": len(records),
           "old_rise_over_3cm": int((old > 0.03).sum()), "new_rise_over_3cm": int((new > 0.03).sum()),
           "old_rise_mean_m": float(old.mean()), "new_rise_mean_m": float(new.mean())}
print(json.dumps(summary))
json.dump({"summary": summary, "requests": records}, open(out, "w"), indent=1)
