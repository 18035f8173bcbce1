"""How the "lifted, not placed" episodes of approach.py's timelines lose the cube: each lift (the cube above 6 cm),
the step it starts, the height reached, how many steps the cube stays above 4 cm, and whether it fell back or was
still carried at the episode's step limit."""
import json, sys
import numpy as np
LIFT, HELD = 0.06, 0.04
for path in sys.argv[1:]:
    for ep in json.load(open(path)):
        if ep["stage"] != "lifted_not_placed":
            continue
        z = np.array(ep["timeline"])[:, 5]  # columns: tcp xyz, cube xyz, gripper, touches
        lifts, t = [], 0
        while t < len(z):
            if z[t] > LIFT:
                start = t
                while t < len(z) and z[t] > HELD:
                    t += 1
                lifts.append({"step": start, "max_z": round(float(z[start:t].max()), 3), "held_steps": t - start,
                              "ended": "carried at the step limit" if t == len(z) else "fell back"})
            t += 1
        print(json.dumps({"seed": ep["seed"], "lifts": lifts}))
