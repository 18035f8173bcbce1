"""`wamrt infer`: one DROID policy request from image files and a JSON state, printed as a table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

IMAGE_ARGS = {
    "image": "observation/image",
    "wrist": "observation/wrist_image_left",
    "exterior1": "observation/exterior_image_1_left",
    "exterior2": "observation/exterior_image_2_left",
}
STATE_KEYS = {"joint_position": "observation/joint_position", "gripper_position": "observation/gripper_position"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-droid", help="checkpoint folder or built-in name (default: tiny-droid)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: next to the checkpoint)")
    ap.add_argument("--vae", help="VAE folder (default: vae/ next to the checkpoint)")
    ap.add_argument("--prompt-format", choices=["plain", "json"], help="caption format (default: checkpoint's)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    for name, key in IMAGE_ARGS.items():
        ap.add_argument(f"--{name}", type=Path, help=f"image file for {key}")
    ap.add_argument("--state", help='JSON file or string: {"joint_position": [7 floats], "gripper_position": x}')
    ap.add_argument("--prompt", help="instruction (default: the sample observation's)")
    ap.add_argument("--seed", type=int, help="noise seed (default: the policy's seed stream, printed with the chunk)")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's, 4)")
    ap.add_argument("--guidance", type=float, help="CFG scale (default: the checkpoint's)")
    ap.add_argument("--shift", type=float, help="flow shift of the schedule (default: the checkpoint's)")
    ap.add_argument("--guidance-interval", type=int, nargs=2, metavar=("LO", "HI"),
                    help="apply CFG only on steps LO..HI (default: every step)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _load_image(path: Path) -> Any:
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def build_observation(args: argparse.Namespace) -> dict[str, Any]:
    from ..pipeline.errors import RequestError
    from ..sample import sample_observation

    given = {key: getattr(args, name) for name, key in IMAGE_ARGS.items() if getattr(args, name) is not None}
    obs: dict[str, Any] = {} if given or args.state else sample_observation()
    for key, path in given.items():
        if not path.is_file():
            raise RequestError(f"no such image file: {path}", field=key)
        obs[key] = _load_image(path)
    if args.state:
        text = Path(args.state).read_text() if Path(args.state).is_file() else args.state
        try:
            state = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(f"not valid JSON ({e})", field="state") from e
        if not isinstance(state, dict):
            raise RequestError("must be a JSON object", field="state")
        for short, key in STATE_KEYS.items():
            if short in state or key in state:
                obs[key] = state.get(short, state.get(key))
    if args.prompt is not None:
        obs["prompt"] = args.prompt
    return obs


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from ..model import CheckpointError
    from ..pipeline import RequestError, load_policy

    try:
        obs = build_observation(args)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype or "")
        policy = load_policy(args.model, device=args.device, dtype=dtype, tokenizer=args.tokenizer, vae=args.vae,
                             prompt_format=args.prompt_format)
        overrides = {k: v for k, v in (("steps", args.steps), ("guidance", args.guidance), ("shift", args.shift),
                                        ("guidance_interval", tuple(args.guidance_interval)
                                         if args.guidance_interval else None)) if v is not None}
        chunk = policy.infer(obs, seed=args.seed, **overrides)
    except (RequestError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"actions": chunk.actions.tolist(), "seed": chunk.seed, "prompt": chunk.prompt,
                          "timings_ms": chunk.timings_ms}))
        return 0
    print(f"{policy}")
    print(f"prompt ({len(chunk.prompt)} chars): {chunk.prompt[:100]}{'...' if len(chunk.prompt) > 100 else ''}")
    print(f"seed {chunk.seed}; action chunk {list(chunk.actions.shape)} float32 "
          "(columns: 7 joint targets [rad], gripper)")
    with np.printoptions(precision=4, suppress=True, linewidth=120):
        for i in (0, 1, 2, None, len(chunk.actions) - 1):
            if i is None:
                print("   ...")
            else:
                print(f"  t+{i:>2}: {chunk.actions[i]}")
    print("stage timings (ms):")
    for k, v in chunk.timings_ms.items():
        if not k.startswith("denoise_step"):
            print(f"  {k:<18}{v:9.1f}")
    steps = [v for k, v in chunk.timings_ms.items() if k.startswith("denoise_step")]
    print(f"  per denoise step  {', '.join(f'{v:.1f}' for v in steps)}")
    return 0
