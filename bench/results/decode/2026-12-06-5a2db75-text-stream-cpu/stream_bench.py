"""Per-token host time of the Reasoner's text stream, the whole-output decode (c543d5c) against the window (this tree)."""
import importlib.util, json, platform, random, statistics, subprocess, sys, tempfile, time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from wamrt.pipeline.builtin import write_tokenizer
from wamrt.reasoner.sampling import TextStream as Window

spec = importlib.util.spec_from_file_location("old_sampling", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["old_sampling"] = old
spec.loader.exec_module(old)
folder = Path(tempfile.mkdtemp()); write_tokenizer(folder)
tok = AutoTokenizer.from_pretrained(folder)
random.seed(0)
text = " ".join(random.choice(["robot", "arm", "cube", "the", "picks", "up", "ü", "°C", "東京"]) for _ in range(3000))
ids = tok(text, add_special_tokens=False)["input_ids"][:8192]
rows = []
for name, cls in (("whole_decode_c543d5c", old.TextStream), ("window", Window)):
    for n in (2048, 8192):
        per_token = []
        for _ in range(7 if name == "window" or n == 2048 else 3):
            s = cls(tok, stop=("STOP",))
            for i in ids[: n - 100]:
                s.push(i)
            t = time.perf_counter()
            for i in ids[n - 100 : n]:
                s.push(i)
            per_token.append((time.perf_counter() - t) / 100 * 1e6)
        per_token.sort()
        rows.append({"stream": name, "tokens": n, "us_per_token_last_100": statistics.median(per_token),
                     "min_max_us": [per_token[0], per_token[-1]], "repeats": len(per_token)})
        print(rows[-1])
sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"kind": "latency", "mode": "text-stream", "command": " ".join(["python", *sys.argv]),
           "git_sha": sha, "host": platform.processor() or platform.machine(), "cpus": 2, "torch": torch.__version__,
           "tokenizer": "wamrt byte-level BPE (write_tokenizer)", "rows": rows},
          open(sys.argv[2], "w"), indent=2)
