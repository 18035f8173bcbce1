import time, statistics, numpy as np, torch
from wamrt import load_policy
from wamrt.sim import PandaEnv
from wamrt.sim.droid import droid_observation
torch.set_num_threads(1)
pol = load_policy("panda-droid", device="cpu")
with PandaEnv("pick_place") as env:
    obs = droid_observation(env.reset(3))
plain = pol.infer(obs, seed=1).actions
prefix = plain[:10]
reqs = {"none": obs, "inpaint": dict(obs, action_prefix=prefix, action_prefix_mode="inpaint"),
        "guided": dict(obs, action_prefix=prefix, action_prefix_mode="guided")}
times = {k: [] for k in reqs}
for k, r in reqs.items():
    pol.infer(r, seed=1)  # warm-up
for rep in range(6):
    for k, r in reqs.items():
        t0 = time.perf_counter(); c = pol.infer(r, seed=rep); times[k].append(1e3 * (time.perf_counter() - t0))
for k, v in times.items():
    print(k, "median ms", round(statistics.median(v), 1), [round(x) for x in v])
