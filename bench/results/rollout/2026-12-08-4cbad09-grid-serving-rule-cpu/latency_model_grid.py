"""The grid's serving rule under a policy-latency model (README.md beside this file).

A backend that sleeps a call's time (default the H100's ~171 ms + 3.9 ms a request; grid.py's MERGE_WAIT_S note)
and answers with a chunk that holds the arm, ending about one episode in ten early so the lanes fall out of step as
they do in a real grid. The simulator workers are real (physics, render, canvases composed in the workers).

PYTHONPATH=<tree>/src python latency_model_grid.py DELAY WORKERS LANES EPISODES [CALL_FIXED_S] -> one JSON line
"""
import json
import sys
import time

import numpy as np

from wamrt.eval import grid
from wamrt.pipeline.droid import DroidContract


class LatencyModelBackend:
    """Takes the workers' prepared host inputs, as an Engine does (canvases composed in the workers)."""
    host_contract = DroidContract(prompt_format="plain", tier="256", normalization=None)
    def __init__(self, fixed_s, per_s): self.fixed_s, self.per_s, self.calls = fixed_s, per_s, 0
    def infer_batch(self, observations, seeds):
        time.sleep(self.fixed_s + self.per_s * len(observations))
        out = []
        for o, seed in zip(observations, seeds):
            if seed is not None and (int(seed) * 2654435761) % 2**32 % 10 == 0:  # ends ~1 episode in 10 requests early
                out.append(RuntimeError("episode ended by the latency model"))
                continue
            hold = np.concatenate([np.asarray(o.state, np.float32).ravel()[:7], np.zeros(1, np.float32)])
            out.append(np.repeat(hold[None], 32, 0))
        return out

if __name__ == "__main__":
    delay, workers, lanes, episodes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    fixed = float(sys.argv[5]) if len(sys.argv) > 5 else 0.171
    cells = grid.plan_cells(["pick_place"], [delay], ["prefix-trained"])
    cells = [c for c in cells if c.delay == delay]
    be = LatencyModelBackend(fixed, 0.0039)
    run = grid.run_grid(cells, list(range(900000, 900000 + episodes)), {"base": be, "trained": be}, workers=workers,
                        lanes=lanes, max_batch=128, max_steps=150)
    n = sum(run.batches)
    print(json.dumps({"delay": delay, "workers": workers, "lanes": lanes, "episodes": episodes, "fixed_s": fixed,
                      "wall_s": round(run.wall_s, 1), "requests": n, "requests_per_s": round(n / run.wall_s, 2),
                      "calls": len(run.batches), "mean_batch": round(n / max(len(run.batches), 1), 1),
                      "policy_busy": round(sum(run.batch_ms) / 1e3 / run.wall_s, 3)}))
