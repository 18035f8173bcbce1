"""The pieces of a Generator pass the engines share: which rows the last layer runs, which requests a pass serves,
and running a pass that pauses between layers to its end."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace
from typing import Any

import torch

from ..model import GeneratorTokens
from ..pipeline.droid import OBSERVED_LATENT_FRAMES


def read_rows(q: torch.Tensor, g: torch.Tensor, tok: GeneratorTokens, which: str, patch: int,
              clean_frames: int = OBSERVED_LATENT_FRAMES) -> tuple[torch.Tensor, torch.Tensor, GeneratorTokens, int]:
    """The rows of the last layer's queries q [B, H, G, d] and hidden states g [B, G, h] whose output is read (rows
    in the order [vision | sound | action]): "action", the last rows; "noisy", all but the `clean_frames` leading
    clean latent frames (a policy's observation, `OBSERVED_LATENT_FRAMES`; a world request's conditioning frames),
    whose velocity is zero, and a transfer request's control rows (before the vision rows, never read). Returns them,
    the tokens their output decodes with and how many leading vision frames the output lacks. The copies keep q's
    memory order
    ([B, G, H, d] under the [B, H, G, d] view, what the head epilogue and SDPA's q have)."""
    clean = 0
    if which == "action":
        assert tok.action is not None
        start = g.shape[1] - tok.action.shape[1]
        tok = replace(tok, vision=None, vision_noisy=None, sound=None, sound_noisy=None)
    elif which == "noisy" and tok.vision is not None and 0 <= clean_frames < tok.vision.shape[2] and (
            clean_frames or tok.controls is not None):
        clean = clean_frames
        frames = tok.vision.shape[2]
        start = tok.control_tokens(patch) + clean * (tok.counts(patch)[0] // frames)
        tok = replace(tok, vision=tok.vision[:, :, clean:], vision_noisy=tok.vision_noisy[:, clean:], controls=None,
                      control_weights=None)
    else:
        raise ValueError(f"last_layer_rows must be 'all', 'noisy' (with vision and 0 < clean_frames < its frames, or "
                         f"controls) or 'action', got {which!r} with clean_frames={clean_frames}")
    q = q.transpose(1, 2)[:, start:].contiguous().transpose(1, 2)
    return q, g[:, start:].contiguous(), tok, clean


def run_to_end(pieces: Generator[None, None, Any]) -> Any:
    """Runs a paused-computation generator (see `Engine._generator_pieces`) through and returns its result."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def select_requests(tok: GeneratorTokens, rows: list[int]) -> GeneratorTokens:
    """The requests `rows` of a token batch (rows may repeat: a request's two CFG branches). Slices
    and cat only: an index tensor built from a host list would be a copy a CUDA graph cannot hold."""
    if rows == list(range(tok.timesteps.shape[0])):
        return tok

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.cat([x[r : r + 1] for r in rows])

    return GeneratorTokens(timesteps=pick(tok.timesteps), vision=pick(tok.vision), vision_noisy=pick(tok.vision_noisy),
                           sound=pick(tok.sound), sound_noisy=pick(tok.sound_noisy), action=pick(tok.action),
                           action_noisy=pick(tok.action_noisy), domain_ids=pick(tok.domain_ids),
                           controls=pick(tok.controls), control_weights=pick(tok.control_weights))
