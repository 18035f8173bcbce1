"""Training data: scripted-expert episodes stored as the padded canvases the policy's VAE encodes.

Recording runs the expert exactly as `wamrt demos record` does (`wamrt.sim.record.record_episode`), turns
every rendered observation into the openpi DROID dict (`wamrt.sim.droid.droid_observation`) and then into
pixels with the serving pipeline's own functions (`compose_droid_canvas` + `pad_to_bucket` at the policy's
tier), so training sees byte for byte what `prepare_droid` feeds the VAE at inference. One uncompressed
`.npz` per episode (canvases are ~250 KB per frame at tier 256; compression costs more than it saves here):

  canvas uint8 [T, H, W, 3]   padded bucket canvas of the observation before action t
  state float32 [T, 8]        the DROID state row (7 joints, 1 - gripper closure) of that observation
  actions float32 [T, 8]      the expert's action t (7 joint targets, gripper 0 open .. 1 closed)
  meta                        JSON: task, seed, prompt, success, length, tier, image_size

An episode may instead carry each frame's chunk explicitly (`chunk` [T, 32, 8] and `prefix_rows` [T]: the on-policy
requests of `wamrt eval grid --record-dagger`, eval/dagger.py): its frames are requests, not consecutive steps, so
its samples take their chunk and their clean prefix from there, and have no future frames. An optional
`grasp_unseen` bool [T] marks chunks whose gripper column after the prefix stays out of the loss (eval/dagger.py), and
an optional `reply` [T, 32, 8] (NaN where the lane got none) is the policy's own reply, which tells the requests where
its gripper disagreed with the label's (`eval.dagger.gripper_disagrees`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..eval.dagger import gripper_disagrees


def policy_canvas(obs_dict: dict[str, Any], tier: str) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    from ..pipeline.canvas import compose_droid_canvas, pad_to_bucket

    padded = pad_to_bucket(compose_droid_canvas(obs_dict), tier)
    return padded.pixels, padded.image_size


def record_canvas_episode(env: Any, expert: Any, seed: int, tier: str,
                          action_noise: float = 0.0) -> tuple[dict[str, np.ndarray], dict]:
    """One expert episode -> canvases, state rows, actions (the sim's own recorder runs the episode;
    `action_noise`: see `wamrt.sim.record.JointNoise`)."""
    from ..sim.droid import droid_observation
    from ..sim.env import Observation
    from ..sim.record import record_episode

    arrays, success = record_episode(env, expert, seed, action_noise)
    prompt = env.layout.instruction
    observations = [
        droid_observation(Observation({cam: arrays[f"image_{cam}"][t] for cam in env.camera_hw},
                                      arrays["joint_position"][t], float(arrays["gripper_position"][t]), prompt, t))
        for t in range(len(arrays["actions"]))
    ]
    out, meta = episode_from_observations(observations, arrays["actions"], tier)
    meta.update(task=env.spec.name, seed=int(seed), success=bool(success), action_noise=float(action_noise))
    return out, meta


def _record_worker(args: tuple[str, list[int], str, str, dict[str, Any], float]) -> list[dict]:
    task, seeds, out_dir, tier, env_kwargs, action_noise = args
    import torch

    torch.set_num_threads(1)
    from ..sim.env import PandaEnv
    from ..sim.expert import ScriptedExpert

    metas = []
    with PandaEnv(task, **env_kwargs) as env:
        expert = ScriptedExpert()
        for seed in seeds:
            arrays, meta = record_canvas_episode(env, expert, seed, tier, action_noise)
            if not meta["success"]:
                metas.append(meta)
                continue
            name = f"{task}_{seed:06d}.npz"
            meta["file"] = name
            # Written under a temporary name and renamed: a deadline terminates the pool mid-write, and a
            # truncated .npz must never be read as an episode.
            final = Path(out_dir) / name
            tmp = final.with_suffix(".npz.part")
            with open(tmp, "wb") as f:
                np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
            os.replace(tmp, final)
            metas.append(meta)
    return metas


def record_canvas_demos(task: str, seeds: Sequence[int], out_dir: str | Path, *, tier: str = "256",
                        workers: int = 1, env_kwargs: dict[str, Any] | None = None,
                        deadline_s: float | None = None, action_noise: float = 0.0) -> list[dict]:
    """Record successful expert episodes in `workers` spawned processes; returns every episode's meta
    (failed ones carry no `file`). `deadline_s` stops handing out work after that many seconds;
    `action_noise` (rad) perturbs the executed joint targets (DART), never the recorded actions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in seeds]
    per = 4  # seeds per work item: small items keep the deadline tight and the workers busy
    items = [(task, seeds[i:i + per], str(out), tier, dict(env_kwargs or {}), float(action_noise))
             for i in range(0, len(seeds), per)]
    metas: list[dict] = []
    t0 = time.perf_counter()
    if workers <= 1:
        for it in items:
            metas += _record_worker(it)
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                break
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            for res in pool.imap_unordered(_record_worker, items):
                metas += res
                if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                    pool.terminate()
                    break
    (out / f"manifest_{task}.json").write_text(json.dumps(metas, indent=1))
    return metas


@dataclass
class DemoSet:
    """All frames of a set of episodes, flattened. Index i is one training sample (frame i and the chunk
    of actions that follows it in its episode)."""

    canvas: np.ndarray  # uint8 [N, H, W, 3]
    state: np.ndarray  # float32 [N, 8]
    actions: np.ndarray  # float32 [N, 8]
    episode_start: np.ndarray  # int64 [N]: index of the first frame of this frame's episode
    episode_end: np.ndarray  # int64 [N]: index one past its last frame
    prompt: list[str]  # per frame
    image_size: tuple[int, int, int, int]
    tier: str
    episodes: int
    # Explicit chunks (DAgger episodes): frame i's chunk is chunks[chunk_row[i]] where chunk_row[i] >= 0, and its
    # first fixed_prefix[i] rows are its clean prefix. None where no episode has any.
    chunk_row: np.ndarray | None = None  # int64 [N], -1: the actions that follow the frame in its episode
    chunks: np.ndarray | None = None  # float32 [M, 32, 8], robot space
    fixed_prefix: np.ndarray | None = None  # int64 [N], -1: drawn in training
    grasp_unseen: np.ndarray | None = None  # bool [M], per chunk: its gripper column after the prefix not learnt
    grip_disagrees: np.ndarray | None = None  # bool [M], per chunk: the policy's reply opened where it closes, or back

    def __len__(self) -> int:
        return len(self.state)


def load_demo_set(files: Sequence[str | Path]) -> DemoSet:
    episodes: list[tuple[dict[str, np.ndarray], dict]] = []
    for f in sorted(files):
        with np.load(f) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in ("canvas", "state", "actions", "chunk", "prefix_rows", "grasp_unseen")
                      if k in z.files}
            if "reply" in z.files:  # only its verdict is kept: the replies are as large as the chunks
                arrays["grip_disagrees"] = gripper_disagrees(z["chunk"], z["reply"], z["prefix_rows"])
        if episodes and meta["tier"] != episodes[0][1]["tier"]:
            raise ValueError(f"{f}: tier {meta['tier']} differs from {episodes[0][1]['tier']}")
        episodes.append((arrays, meta))
    return demo_set_from_episodes(episodes)


def load_demo_dirs(dirs: Sequence[str | Path]) -> DemoSet:
    """Every recorded episode (*.npz) in these folders; FileNotFoundError naming them when there is none."""
    files = [f for d in dirs for f in sorted(Path(d).glob("*.npz"))]
    if not files:
        where = ", ".join(map(str, dirs))
        raise FileNotFoundError(f"no .npz episodes in {where} (write them with `wamrt train record`)")
    return load_demo_set(files)


def chunk_indices(ds: DemoSet, idx: np.ndarray, chunk: int) -> np.ndarray:
    """[B, chunk] frame indices of the actions that follow each sample (the last one repeated at the end)."""
    steps = idx[:, None] + np.arange(chunk)[None]
    return np.minimum(steps, ds.episode_end[idx, None] - 1)


def episode_from_observations(observations: Sequence[dict[str, Any]], actions: np.ndarray, tier: str = "256"
                              ) -> tuple[dict[str, np.ndarray], dict]:
    """openpi DROID observation dicts (+ the action taken after each) -> the arrays of one recorded episode,
    built exactly as the recorder builds them (tests, other data sources)."""
    from ..pipeline.noise import droid_state_row

    canv, states, size = [], [], None
    for d in observations:
        pixels, size = policy_canvas(d, tier)
        canv.append(pixels)
        states.append(droid_state_row(d["observation/joint_position"], d["observation/gripper_position"]))
    arrays = {"canvas": np.stack(canv), "state": np.stack(states).astype(np.float32),
              "actions": np.asarray(actions, np.float32)}
    meta = {"prompt": observations[0]["prompt"], "tier": tier, "image_size": list(size or ()),
            "length": len(actions), "success": True}
    return arrays, meta


def demo_set_from_episodes(episodes: Sequence[tuple[dict[str, np.ndarray], dict]]) -> DemoSet:
    """Recorded (or built) episodes, each (arrays, meta), flattened into one DemoSet."""
    if not episodes:
        raise ValueError("no episodes")
    canv, st, act, starts, ends, prompts = [], [], [], [], [], []
    chunk_row, chunks, fixed, unseen, disagrees = [], [], [], [], []
    n = m = 0
    for arrays, meta in episodes:
        t = len(arrays["actions"])
        if "chunk" in arrays:
            chunk_row.append(np.arange(m, m + t))
            chunks.append(np.asarray(arrays["chunk"], np.float32))
            fixed.append(np.asarray(arrays["prefix_rows"], np.int64))
            unseen.append(np.asarray(arrays.get("grasp_unseen", np.zeros(t, bool)), bool))
            disagrees.append(np.asarray(arrays.get("grip_disagrees", np.zeros(t, bool)), bool))
            m += t
        else:
            chunk_row.append(np.full(t, -1))
            fixed.append(np.full(t, -1))
        canv.append(arrays["canvas"])
        st.append(arrays["state"])
        act.append(arrays["actions"])
        starts.append(np.full(t, n))
        ends.append(np.full(t, n + t))
        prompts += [meta["prompt"]] * t
        n += t
    meta0 = episodes[0][1]
    explicit = {"chunk_row": np.concatenate(chunk_row).astype(np.int64), "chunks": np.concatenate(chunks),
                "fixed_prefix": np.concatenate(fixed), "grasp_unseen": np.concatenate(unseen),
                "grip_disagrees": np.concatenate(disagrees)} if chunks else {}
    return DemoSet(np.concatenate(canv), np.concatenate(st), np.concatenate(act), np.concatenate(starts),
                   np.concatenate(ends), prompts, tuple(meta0["image_size"]), meta0["tier"], len(episodes),  # type: ignore[arg-type]
                   **explicit)
