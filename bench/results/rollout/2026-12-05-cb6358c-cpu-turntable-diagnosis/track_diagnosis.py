import numpy as np, torch
from wamrt import load_policy
from wamrt.engine import Engine, EngineConfig
from wamrt.eval.agents import PolicyAgent
from wamrt.eval.runner import run_episode
from wamrt.sim.env import PandaEnv
torch.set_num_threads(2)
eng = Engine.from_policy(load_policy("/work/ck36", device="cpu"), EngineConfig(attention="auto", compile=False, cuda_graph=False))
class Logged(PolicyAgent):
    def actions(self, env, obs):
        cube = env.cube_pos(env.layout.target); tcp = env.tcp_pos()
        c = env.layout.turntable_xy
        ang_cube = np.degrees(np.arctan2(*(cube[:2]-c)[::-1])); ang_tcp = np.degrees(np.arctan2(*(tcp[:2]-c)[::-1]))
        self.log.append((self.requests*8, np.linalg.norm(tcp-cube), tcp[2]-cube[2], ang_cube, ang_tcp, np.linalg.norm(tcp[:2]-c)))
        return super().actions(env, obs)
for seed in (0, 1, 2):
    with PandaEnv("turntable") as env:
        ag = Logged(eng); ag.log = []
        res = run_episode(env, ag, seed)
        print("seed", seed, "success", res.success, "speed", round(env.layout.turntable_speed, 3))
        for row in ag.log[:20]:
            print("  step %3d dist %.3f dz %.3f ang cube %7.1f tcp %7.1f tcp_r %.3f" % row)
