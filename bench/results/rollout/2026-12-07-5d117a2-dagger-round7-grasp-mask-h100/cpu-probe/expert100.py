import sys, time, json
from wamrt.sim.env import PandaEnv
from wamrt.sim.expert import ScriptedExpert
task, n = sys.argv[1], int(sys.argv[2])
ok, steps, t0 = 0, [], time.time()
with PandaEnv(task, render=False) as env:
    for seed in range(n):
        env.reset(seed, render=False); ex = ScriptedExpert(); ex.reset(env)
        for t in range(env.spec.max_steps):
            env.step(ex.act(env), render=False)
            if env.success():
                ok += 1; steps.append(t + 1); break
print(json.dumps({"task": task, "seeds": f"0-{n-1}", "success": ok, "median_steps": sorted(steps)[len(steps)//2] if steps else None, "seconds": round(time.time()-t0,1)}))
