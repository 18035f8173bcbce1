"""Counts, over the probe's requests near the cube, how the policy's gripper over its executed rows disagrees with
the label's: closes where the label stays open, or stays open where the label closes."""
import json, sys
rows = [ep for f in sys.argv[1:] for ep in json.load(open(f))]
tot = {"requests": 0, "agree": 0, "policy_closes_label_open": 0, "policy_open_label_closes": 0}
for ep in rows:
    c = {k: 0 for k in tot}
    for r in ep["requests"]:
        p, l = r["grip_policy_label"]
        c["requests"] += 1
        if p > 0.5 and l < 0.5:
            c["policy_closes_label_open"] += 1
        elif p < 0.5 and l > 0.5:
            c["policy_open_label_closes"] += 1
        else:
            c["agree"] += 1
    print(ep["seed"], ep["stage"], c)
    for k in tot:
        tot[k] += c[k]
print("all", tot)
