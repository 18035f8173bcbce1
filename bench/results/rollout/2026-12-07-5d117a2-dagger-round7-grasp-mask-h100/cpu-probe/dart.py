import sys, json
import numpy as np
from wamrt.sim.env import PandaEnv
from wamrt.sim.expert import ScriptedExpert
from wamrt.sim.record import JointNoise
task, s0, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ok = 0; fails = []
with PandaEnv(task, render=False) as env:
    ex = ScriptedExpert()
    for seed in range(s0, s0 + n):
        env.reset(seed, render=False); ex.reset(env); noise = JointNoise(0.02, seed=seed)
        phases = []
        succ = False
        for t in range(env.spec.max_steps):
            a = ex.act(env)
            if not phases or phases[-1][1] != ex.phase: phases.append((t, ex.phase, round(env.gripper_position(), 2)))
            env.step(noise(a), render=False)
            if env.success(): succ = True; break
        ok += succ
        if not succ: fails.append((seed, phases[:14]))
print(task, ok, "/", n)
for f in fails[:3]: print(f)
