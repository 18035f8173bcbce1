"""Prefix-conditioned DROID requests: the committed rows a robot executes while a request is in flight.

A robot that keeps moving while the model thinks has, at request time, already committed the next d rows (the
old chunk's rows it executes until the reply arrives). The request carries them as `action_prefix` [d, 8], in
robot space exactly like the rows a reply holds; the reply's rows 0..d-1 equal them and its rows d.. continue
from them. Three ways to make the chunk continue from them:

* "clean" (training-time RTC, Black et al. 2025, arXiv 2512.05964): the prefix rows are clean conditioning rows
  right after the clean state row -- no time embedding, velocity zero (`GeneratorTokens.action_noisy` False),
  what a checkpoint trained with random clean prefixes (`wamrt train fit --prefix-max`) has learned to read.
  No extra compute.
* "inpaint" (for checkpoints never trained that way): the prefix rows stay noisy rows, and before every step
  they are put back at that step's noise level, x = (1 - sigma) prefix + sigma eps (the row's own initial noise),
  so the model sees a trajectory whose start is the prefix and denoises the rest consistently with it. Cheap: a
  few elementwise kernels, no backward pass.
* "guided" (inference-time RTC, Black, Galliker & Levine 2025, arXiv 2506.07339): "inpaint", plus at every step
  the action velocity is corrected by a vector-Jacobian product that pulls the model's own estimate of the clean
  prefix rows towards the prefix. The free rows then change so that the model reads them as continuing the
  prefix, which re-anchoring alone does not reach in few steps. It costs a backward pass per step (both CFG
  branches), so only the eager reference runs it (`run_droid`, the library's `Policy`); the engine refuses it
  with a RequestError naming `action_prefix_mode`. The rows are weighted 1 (RTC's hard mask: the request holds
  no rows of the old plan beyond the committed ones for its soft tail).

"auto" (the default) is "clean" when the checkpoint's wamrt.json says `"trained_with_action_prefix": true`,
else "inpaint". Every mode re-anchors the prefix rows after every step, so the reply's prefix rows equal the
request's up to float rounding (the normalization round trip) in either.

Everything the loop needs is device data of fixed shape ([B, rows, A] values and a [B, rows, 1] mask), so one
captured denoising graph serves every d and both modes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import torch

from .errors import RequestError

PREFIX_KEY = "action_prefix"
PREFIX_MODE_KEY = "action_prefix_mode"
PREFIX_MODES = ("auto", "clean", "inpaint", "guided")
MAX_PREFIX_ROWS = 16  # the interface between the robot-side runner and the servers (half the 32-row chunk)
TRAINED_KEY = "trained_with_action_prefix"  # wamrt.json: the checkpoint was trained with random clean prefixes

PrefixMode = Literal["clean", "inpaint", "guided"]
# RTC's clip on the guidance weight (beta): the weight's schedule diverges at full noise and at clean.
GUIDANCE_CLIP = 5.0


@dataclass(frozen=True)
class ActionPrefix:
    """A validated `action_prefix`: rows [d, raw_dim] float32 in robot space (d >= 1) and the requested mode."""

    rows: np.ndarray
    mode: str = "auto"

    def resolve(self, trained: bool) -> PrefixMode:
        if self.mode == "auto":
            return "clean" if trained else "inpaint"
        return self.mode  # type: ignore[return-value]


def parse_action_prefix(obs: Mapping[str, Any], *, raw_dim: int = 8,
                        max_rows: int = MAX_PREFIX_ROWS) -> ActionPrefix | None:
    """The observation's optional prefix keys, validated (RequestError naming the field); None when absent or
    d = 0. Shapes [d, raw_dim]; an empty list or a [0] / [0, raw_dim] array is d = 0."""
    mode = obs.get(PREFIX_MODE_KEY, "auto")
    if isinstance(mode, bytes):
        mode = mode.decode("utf-8", "replace")
    if mode is None:
        mode = "auto"
    if not isinstance(mode, str) or mode not in PREFIX_MODES:
        raise RequestError(f"must be one of {list(PREFIX_MODES)}, got {mode!r}", field=PREFIX_MODE_KEY)
    value = obs.get(PREFIX_KEY)
    if value is None:
        return None
    try:
        rows = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"is not numeric ({exc})", field=PREFIX_KEY) from None
    if rows.size == 0 and rows.ndim <= 2 and (rows.ndim < 2 or rows.shape[1] in (0, raw_dim)):
        return None
    if rows.ndim != 2 or rows.shape[1] != raw_dim:
        raise RequestError(f"must have shape [d, {raw_dim}], got {list(rows.shape)}", field=PREFIX_KEY)
    if rows.shape[0] > max_rows:
        raise RequestError(f"has {rows.shape[0]} rows, at most {max_rows} are accepted", field=PREFIX_KEY)
    if not np.isfinite(rows).all():
        raise RequestError("contains NaN or inf", field=PREFIX_KEY)
    return ActionPrefix(np.ascontiguousarray(rows), mode)


@dataclass
class ActionAnchor:
    """Rows the denoising loop puts back before its first step and after every step, at the state's noise level
    sigma: x = where(mask, value + sigma * delta, x). Clean rows have delta 0 (always their value); inpainted
    rows delta = eps - value ((1 - sigma) value + sigma eps). Shapes fixed by the contract, so one captured
    graph reads any prefix."""

    value: torch.Tensor  # [B, rows, A] fp32: the normalized prefix on its rows, 0 elsewhere
    delta: torch.Tensor  # [B, rows, A] fp32
    mask: torch.Tensor  # [B, rows, 1] bool
    guidance: torch.Tensor | None = None  # [B, rows, 1] fp32 RTC weights ("guided"; eager reference only)

    @staticmethod
    def cat(anchors: list[ActionAnchor]) -> ActionAnchor:
        if any(a.guidance is not None for a in anchors):
            raise ValueError("guided prefixes run one request at a time, in the eager reference")
        if len(anchors) == 1:
            return anchors[0]
        return ActionAnchor(*(torch.cat([getattr(a, f) for a in anchors]) for f in ("value", "delta", "mask")))


def apply_anchor(x: torch.Tensor, anchor: ActionAnchor, sigma: float) -> torch.Tensor:
    """The loop's action state with the anchored rows at noise level `sigma` (fp32, a host scalar: capturable)."""
    return torch.where(anchor.mask, anchor.value + sigma * anchor.delta, x)


@lru_cache(maxsize=16)
@torch.inference_mode(False)
def empty_anchor(rows: int, width: int, device: torch.device | str) -> ActionAnchor:
    """The anchor of a request without a prefix (nothing put back): shared, never write into it."""
    zeros = torch.zeros(1, rows, width, device=device)
    return ActionAnchor(zeros, zeros, torch.zeros(1, rows, 1, dtype=torch.bool, device=device))


def prefix_anchor(model_rows: np.ndarray, noise: np.ndarray, *, history: int, mode: PrefixMode,
                  device: torch.device | str) -> ActionAnchor:
    """model_rows [d, raw_dim]: the prefix in model space (normalized as the chunk rows are); noise [rows, A]: the
    request's initial action state (its noise on the chunk rows). The prefix occupies rows history..history+d-1."""
    d, raw_dim = model_rows.shape
    rows, width = noise.shape
    value = np.zeros((rows, width), np.float32)
    value[history:history + d, :raw_dim] = model_rows
    delta = np.zeros((rows, width), np.float32)
    if mode in ("inpaint", "guided"):
        delta[history:history + d, :raw_dim] = noise[history:history + d, :raw_dim] - model_rows
    mask = np.zeros((rows, 1), bool)
    mask[history:history + d] = True
    to = lambda a: torch.from_numpy(a)[None].to(device)  # noqa: E731
    guidance = None
    if mode == "guided":
        weights = np.zeros((rows, 1), np.float32)
        weights[history:history + d] = 1.0
        guidance = to(weights)
    return ActionAnchor(to(value), to(delta), to(mask), guidance)


def guidance_weight(sigma: float, clip: float = GUIDANCE_CLIP) -> float:
    """RTC's weight on the correction at noise level sigma (our sigma = 1 - RTC's t): min(clip, (1 - t) / t / r^2)
    with r^2 = (1 - t)^2 / (t^2 + (1 - t)^2), the variance of the clean estimate's posterior; clipped where t = 0."""
    t = 1.0 - sigma
    if t <= 0.0:
        return clip
    r2 = (1.0 - t) ** 2 / (t**2 + (1.0 - t) ** 2)
    return clip if r2 == 0.0 else min(clip, (1.0 - t) / t / r2)


def guided_velocity(velocity: Any, x: torch.Tensor, sigma: float, anchor: ActionAnchor) -> torch.Tensor:
    """The RTC-corrected action velocity at state x (noise level sigma). `velocity(x)` is the step's (guided-CFG)
    velocity as a differentiable function of the action state; ours points from data to noise (x_next = x +
    (sigma_next - sigma) v), so the clean estimate is x - sigma v and the correction is subtracted."""
    assert anchor.guidance is not None
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        v = velocity(x_in)
        clean = x_in - sigma * v
        error = (anchor.value - clean) * anchor.guidance
        (correction,) = torch.autograd.grad(clean, x_in, grad_outputs=error)
    return v.detach() - guidance_weight(sigma) * correction


def model_space_prefix(rows: np.ndarray, state: np.ndarray, normalization: Any | None) -> np.ndarray:
    """Robot-space prefix rows [d, 8] (gripper in the client's convention) -> the model space the chunk rows are
    generated in: the gripper flipped as the DROID contract flips it, then the checkpoint's action normalization
    of chunk rows 0..d-1 (joints relative to the request's raw state row, per-row statistics)."""
    out = np.array(rows, np.float32, copy=True)
    out[:, -1] = 1.0 - out[:, -1]
    if normalization is not None:
        out = normalization.rows_in(out, state)
    return out.astype(np.float32)


def prefix_metadata(trained: bool, *, guided: bool = True) -> dict[str, Any]:
    """What a client needs to know before sending prefixes (the handshake's `action_prefix`): the modes this
    implementation accepts ("guided" only where a backward pass runs: the eager reference)."""
    modes = [m for m in PREFIX_MODES if guided or m != "guided"]
    return {"max_rows": MAX_PREFIX_ROWS, "modes": modes, "auto": "clean" if trained else "inpaint",
            "trained_with_action_prefix": trained}
