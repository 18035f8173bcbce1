"""Record scripted-expert demonstrations: one compressed .npz per episode plus a manifest.

Episode file `episode_{index:06d}.npz`: for t = 0..T-1 the observation *before* action t
(`image_{camera}` uint8 [T, H, W, 3], `joint_position` float32 [T, 7], `gripper_position` float32 [T])
and the action taken (`actions` float32 [T, 8]), plus `meta` (a JSON string: task, seed, prompt, success,
length, fps, cameras). `manifest.json` lists the episodes. The LeRobot exporter reads this layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .env import CONTROL_HZ, JointNoise, PandaEnv
from .expert import ScriptedExpert

HOLD_STEPS = 5  # keep recording a little after success, so a policy also sees "done, stay put"


@dataclass
class EpisodeMeta:
    index: int
    task: str
    seed: int
    prompt: str
    success: bool
    length: int
    fps: int
    cameras: list[str]
    file: str


def record_episode(env: PandaEnv, expert: ScriptedExpert, seed: int,
                   action_noise: float = 0.0) -> tuple[dict[str, np.ndarray], bool]:
    """Run the expert on one seed. With `action_noise` > 0 (rad) the executed joint targets carry
    `JointNoise`; the recorded `actions` are always the expert's clean ones."""
    obs = env.reset(seed)
    expert.reset(env)
    noise = JointNoise(action_noise, seed)
    frames: dict[str, list[np.ndarray]] = {f"image_{c}": [] for c in env.camera_hw}
    joints, grip, actions = [], [], []
    success, hold = False, 0
    for _ in range(env.spec.max_steps):
        action = expert.act(env)
        for cam, img in obs.images.items():
            frames[f"image_{cam}"].append(img)
        joints.append(obs.joint_position.astype(np.float32))
        grip.append(np.float32(obs.gripper_position))
        actions.append(action)
        obs = env.step(noise(action))
        if env.halted:  # a protective stop (reflexes): the arm will not move again
            break
        success = success or env.success()
        if success:
            hold += 1
            if hold > HOLD_STEPS:
                break
    arrays = {k: np.stack(v) for k, v in frames.items()}
    arrays.update(joint_position=np.stack(joints), gripper_position=np.array(grip, dtype=np.float32),
                  actions=np.stack(actions).astype(np.float32))
    return arrays, success


def record_demos(task: str, seeds: Iterable[int], out_dir: str | Path, *, success_only: bool = True,
                 env_kwargs: dict[str, Any] | None = None) -> list[EpisodeMeta]:
    """Run the expert on each seed and write the episodes (failed ones too unless success_only)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metas: list[EpisodeMeta] = []
    with PandaEnv(task, **(env_kwargs or {})) as env:
        expert = ScriptedExpert()
        for seed in seeds:
            arrays, success = record_episode(env, expert, seed)
            if success_only and not success:
                continue
            index = len(metas)
            meta = EpisodeMeta(index, task, int(seed), env.layout.instruction if env.layout else "", success,
                               len(arrays["actions"]), CONTROL_HZ, list(env.camera_hw),
                               f"episode_{index:06d}.npz")
            np.savez_compressed(out / meta.file, meta=np.array(json.dumps(asdict(meta))), **arrays)
            metas.append(meta)
    (out / "manifest.json").write_text(json.dumps([asdict(m) for m in metas], indent=1))
    return metas


def load_episode(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(str(z["meta"]))
    return arrays, meta
