import sys
import numpy as np, torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings, LaneEpisode
from wamrt.client.clocks import LatencyModel
task, d, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
others = sys.argv[4].split(",") if len(sys.argv) > 4 else []
torch.set_num_threads(1)
policy = load_policy("panda-droid-rt", device="cpu")
alts = {o: load_policy(o, device="cpu") for o in others}
env = PandaEnv(task, render=True)
cap = []
orig = policy.infer
def infer(obs, *a, **k):
    r = orig(obs, *a, **k)
    tgt = env.layout.target
    cap.append((dict(obs), float(env.cube_pos(tgt)[2]), bool(env.touches_gripper(tgt)), float(np.abs(env.cube_pos(tgt)[:2] - env.layout.pad_xy).max())))
    return r
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
def opens(p, o, k):
    n = 0
    for s in range(8):
        a = np.asarray(p.infer(o, seed=100 + s).actions)
        n += int((a[k:k + 10, 7] < 0.5).any())
    return n
for obs, cz, touch, dpad in cap:
    if not (touch and cz > 0.06):
        continue
    k = len(obs.get("action_prefix", []))
    noprefix = {kk: v for kk, v in obs.items() if not kk.startswith("action_prefix")}
    line = f"cube_z {cz:.3f} pad_off {dpad:.3f} k {k}: rt opens in {opens(policy, obs, k)}/8 with its prefix, {opens(policy, noprefix, 0)}/8 without"
    for name, p in alts.items():
        line += f"; {name}: {opens(p, obs, k)}/8, {opens(p, noprefix, 0)}/8"
    print(line, flush=True)
