import json, sys
import numpy as np, torch
from wamrt.pipeline.policy import load_policy
from wamrt.sim.env import PandaEnv
from wamrt.eval.realtime import RealtimeAgent, RealtimeSettings, LaneEpisode
from wamrt.eval.planner import snapshot, ExpertPlanner, SIM_STATE_KEY
from wamrt.client.clocks import LatencyModel
task, d, seeds, out = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
torch.set_num_threads(1)
policy = load_policy("panda-droid-rt", device="cpu")
planner = ExpertPlanner(task)
recs = []
for seed in seeds:
    env = PandaEnv(task, render=True)
    cap = []
    orig = policy.infer
    def infer(obs, *a, **k):
        r = orig(obs, *a, **k)
        cap.append((dict(obs), snapshot(env, seed), np.asarray(r.actions)))
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
    for obs, snap, acts in cap:
        pre = np.asarray(obs.get("action_prefix", np.zeros((0, 8))))
        k = len(pre)
        if not k or pre[-1, 7] < 0.5:
            continue
        lab = planner.infer({**obs, SIM_STATE_KEY: snap})["actions"]
        # the planner's private simulator is now 32 rows on; re-run the prefix to see the state it resumed from
        pe = planner.env
        pe.reset(seed, render=False)
        import mujoco
        mujoco.mj_copyData(pe.data, pe.model, snap.data)
        pe.last_action, pe.step_count, pe.halted = snap.last_action.copy(), snap.step, snap.halted
        pe._held = snap.last_action.copy()
        for r in pre:
            pe.step(r, render=False)
        tgt = pe.layout.target
        held = bool(pe.touches_gripper(tgt) and pe.cube_pos(tgt)[2] > 0.035)
        recs.append({"seed": seed, "step": snap.step, "held_after_prefix": held,
                     "label_opens": bool((lab[k:k + 10, 7] < 0.5).any()),
                     "policy_opens": bool((acts[k:k + 10, 7] < 0.5).any())})
    print(seed, ep.success, len(cap), flush=True)
    env.close()
json.dump(recs, open(out, "w"), indent=1)
import collections
c = collections.Counter((r["held_after_prefix"], r["label_opens"], r["policy_opens"]) for r in recs)
print(json.dumps({f"held={h} label_opens={l} policy_opens={p}": n for (h, l, p), n in sorted(c.items())}, indent=1))
