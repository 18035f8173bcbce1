"""Turntable, d = 10, panda-droid-rt (round 9) on the CPU, episodes the grid scored "reached, not lifted": at each
request while the TCP is near the cube, where the policy's executed rows (d .. d+7) put the TCP against where the
planner's label puts it and against the cube at those steps; the gripper of each."""
import json, sys
import numpy as np, torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings
from wamrt.eval.planner import snapshot, ExpertPlanner, SIM_STATE_KEY
from wamrt.client.clocks import LatencyModel
torch.set_num_threads(1)
task, d, seeds, out = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
policy = load_policy("panda-droid-rt", device="cpu")
planner = ExpertPlanner(task)
env = PandaEnv(task, render=True)
cap, steps = [], []
orig = policy.infer
def infer(obs, *a, **k):
    r = orig(obs, *a, **k)
    cap.append((dict(obs), snapshot(env, cur_seed), np.asarray(r.actions)))
    return r
policy.infer = infer
agent = RealtimeAgent(policy, RealtimeSettings(strategy="prefix" if d > 0 else "async", latency=LatencyModel(steps=d),
                                                prefix_mode="clean"))
orig_step = env.step
def step(*a, **k):
    r = orig_step(*a, **k)
    tgt = env.layout.target
    steps.append([*map(float, env.tcp_pos()), *map(float, env.cube_pos(tgt)), float(env.gripper_position()),
                  float(env.touches_gripper(tgt))])
    return r
env.step = step
res = []
for cur_seed in seeds:
    cap.clear(); steps.clear()
    r = agent.episode(env, cur_seed)
    tl = np.array(steps)
    fk = lambda row: planner.expert.ik.forward(np.asarray(row[:7], np.float64))[0]
    reqs = []
    for obs, snap, acts in cap:
        t = snap.step
        if t + d + 8 > len(tl):
            continue
        tcp, cube = tl[t - 1, :3] if t > 0 else tl[0, :3], tl[t - 1, 3:6] if t > 0 else tl[0, 3:6]
        if np.linalg.norm(tcp[:2] - cube[:2]) > 0.08 or cube[2] > 0.2:
            continue
        lab = planner.infer({**obs, SIM_STATE_KEY: snap})["actions"]
        rows = range(d, d + 8)
        pol_xy = np.array([fk(acts[i])[:2] for i in rows]); lab_xy = np.array([fk(lab[i])[:2] for i in rows])
        pol_z = np.array([fk(acts[i])[2] for i in rows]); lab_z = np.array([fk(lab[i])[2] for i in rows])
        cube_xy = tl[t + d: t + d + 8, 3:5]
        reqs.append({"step": t, "tcp_cube_xy_now": round(float(np.linalg.norm(tcp[:2] - cube[:2])), 3),
                     "tcp_z_now": round(float(tcp[2]), 3),
                     "policy_to_cube": [round(float(x), 3) for x in np.linalg.norm(pol_xy - cube_xy, axis=1)[[0, 7]]],
                     "label_to_cube": [round(float(x), 3) for x in np.linalg.norm(lab_xy - cube_xy, axis=1)[[0, 7]]],
                     "policy_label_xy": round(float(np.linalg.norm(pol_xy - lab_xy, axis=1).mean()), 3),
                     "z_policy_label": [round(float(pol_z[7]), 3), round(float(lab_z[7]), 3)],
                     "grip_policy_label": [round(float(acts[list(rows)][:, 7].mean()), 2), round(float(lab[list(rows)][:, 7].mean()), 2)]})
        print(cur_seed, reqs[-1], flush=True)
    res.append({"seed": cur_seed, "success": r.success, "stage": r.stage, "steps": r.steps, "requests": reqs,
                "timeline": tl.round(4).tolist()})
    print("seed", cur_seed, r.success, r.stage, r.steps, flush=True)
json.dump(res, open(out, "w"))
