"""Seed 24, pick_place, d = 0, round 7 on the CPU: at each request while the cube is held near the pad, the
planner's label against the policy's reply -- how far each lowers the TCP over the 8 rows the lane runs."""
import json, sys
import numpy as np, torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings
from wamrt.eval.planner import snapshot, ExpertPlanner, SIM_STATE_KEY
from wamrt.client.clocks import LatencyModel
import mujoco  # noqa: F401  (after wamrt.sim)
torch.set_num_threads(1)
seed, ckpt = int(sys.argv[1]), sys.argv[2]
policy = load_policy(ckpt, device="cpu")
planner = ExpertPlanner("pick_place")
env = PandaEnv("pick_place", render=True)
cap = []
orig = policy.infer
def infer(obs, *a, **k):
    r = orig(obs, *a, **k)
    cap.append((dict(obs), snapshot(env, seed), np.asarray(r.actions), env.tcp_pos().copy(),
                env.cube_held(env.layout.target)))
    return r
policy.infer = infer
agent = RealtimeAgent(policy, RealtimeSettings(strategy="async", latency=LatencyModel(steps=0)))
print("success", agent.episode(env, seed).success)
pad = env.layout.pad_xy
ik = planner.expert
out = []
for obs, snap, acts, tcp, held in cap:
    if not held or np.linalg.norm(tcp[:2] - pad) > 0.08:
        continue
    lab = planner.infer({**obs, SIM_STATE_KEY: snap})["actions"]
    phase0 = planner.expert.phase
    fz = lambda rows: [float(planner.expert.ik.forward(np.asarray(r[:7], np.float64))[0][2]) for r in rows]
    fxy = lambda rows: [planner.expert.ik.forward(np.asarray(r[:7], np.float64))[0][:2] for r in rows]
    lz, pz = fz(lab[:8]), fz(acts[:8])
    lxy, pxy = fxy(lab[:8]), fxy(acts[:8])
    rec = {"step": snap.step, "tcp_z": round(float(tcp[2]), 3), "pad_dist": round(float(np.linalg.norm(tcp[:2] - pad)), 3),
           "label_dz8": round(lz[-1] - float(tcp[2]), 3), "policy_dz8": round(pz[-1] - float(tcp[2]), 3),
           "label_pad_dist8": round(float(np.linalg.norm(lxy[-1] - pad)), 3),
           "policy_pad_dist8": round(float(np.linalg.norm(pxy[-1] - pad)), 3),
           "label_opens": int((lab[:8, 7] < 0.5).sum()), "policy_opens": int((acts[:8, 7] < 0.5).sum())}
    out.append(rec)
    print(rec, flush=True)
json.dump(out, open(f"/tmp/probe7/hover-{seed}.json", "w"), indent=1)
