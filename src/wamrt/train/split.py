"""Which frames a training run learns from, which it holds out, and how often each is drawn.

Held out: whole episodes, never drawn. `val_episodes` are the last episodes in file order (in a DAgger round the
last task's expert demos); `val_dagger_episodes` are DAgger episodes spread evenly over those recorded, because a
policy's own states are what a round is judged on. Each held-out set is scored on one fixed batch of its frames.
Drawn: a DAgger frame `dagger_repeat` times as often as a demo frame (those recorded without a prefix
`dagger_d0_repeat` times), and one whose reply's gripper disagreed with its label `dagger_disagree_repeat` times
that again (the grasp decisions the policy gets wrong are few and decide the episode).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import TrainConfig
from .data import DemoSet


@dataclass
class FrameSplit:
    train: np.ndarray  # frame indices trained on, ascending
    val: np.ndarray | None  # a fixed batch of the held-out demo episodes' frames
    val_dagger: np.ndarray | None  # a fixed batch of the held-out DAgger episodes' frames


def fixed_batch(pool: np.ndarray, size: int, seed: int) -> np.ndarray:
    pick = np.random.default_rng(seed).choice(len(pool), min(size, len(pool)), replace=False)
    return np.sort(pool[pick])


def split_frames(ds: DemoSet, cfg: TrainConfig) -> FrameSplit:
    starts = np.unique(ds.episode_start)
    if not 0 <= cfg.val_episodes < len(starts):
        raise ValueError(f"val_episodes must be in [0, {len(starts) - 1}] for {len(starts)} episodes, "
                         f"got {cfg.val_episodes}")
    first_val = int(starts[len(starts) - cfg.val_episodes]) if cfg.val_episodes else len(ds)
    train = np.arange(first_val)
    val = fixed_batch(np.arange(first_val, len(ds)), cfg.val_batch, cfg.seed + 1) if cfg.val_episodes else None
    val_dagger = None
    if cfg.val_dagger_episodes:
        dagger_starts = starts[starts < first_val]
        if ds.chunk_row is not None:
            dagger_starts = dagger_starts[ds.chunk_row[dagger_starts] >= 0]
        else:
            dagger_starts = dagger_starts[:0]
        if not 0 < cfg.val_dagger_episodes < len(dagger_starts):
            raise ValueError(f"val_dagger_episodes must be in [0, {max(len(dagger_starts) - 1, 0)}] for "
                             f"{len(dagger_starts)} DAgger episodes in training, got {cfg.val_dagger_episodes}")
        spread = np.unique(np.linspace(0, len(dagger_starts) - 1, cfg.val_dagger_episodes).round().astype(int))
        held = np.isin(ds.episode_start[:first_val], dagger_starts[spread])
        train = train[~held]
        val_dagger = fixed_batch(np.flatnonzero(held), cfg.val_batch, cfg.seed + 2)
    return FrameSplit(train, val, val_dagger)


def draw_pool(ds: DemoSet, train: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """The training frames, each repeated as often as it is to be drawn: a uniform draw from this pool is the
    weighted draw the module docstring describes."""
    if ds.chunk_row is None or ds.fixed_prefix is None:
        return train
    own = train[ds.chunk_row[train] >= 0]
    at_d0 = ds.fixed_prefix[own] == 0
    d0_repeat = cfg.dagger_repeat if cfg.dagger_d0_repeat is None else cfg.dagger_d0_repeat
    pool = np.concatenate([train, np.repeat(own[~at_d0], cfg.dagger_repeat - 1),
                           np.repeat(own[at_d0], d0_repeat - 1)])
    if ds.grip_disagrees is not None and cfg.dagger_disagree_repeat > 1:
        rows = ds.chunk_row[own]
        unseen = ds.grasp_unseen[rows] if ds.grasp_unseen is not None else np.zeros(len(own), bool)
        again = ds.grip_disagrees[rows] & ~unseen
        draws = np.where(at_d0, d0_repeat, cfg.dagger_repeat)[again] * (cfg.dagger_disagree_repeat - 1)
        pool = np.concatenate([pool, np.repeat(own[again], draws)])
    return pool
