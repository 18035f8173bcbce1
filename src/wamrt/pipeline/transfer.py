"""Video transfer as NVIDIA's cosmos-framework runs it on the base checkpoints: the target video generated next to
N clean control videos (edge, blur, depth, segmentation; `controls.py`) in one sequence
[text | control_1 ... control_N | target].

* Every control is encoded by the same VAE and projected by the same `proj_in` as the target; its latent frames
  are clean (no time embedding, no velocity) and sit on the target's own (t, h, w) RoPE grid.
* With N > 1 controls each layer attends in N passes (`model.attention.control_attention`), the target's output the
  weighted sum of the passes' (weights normalised to 1).
* Guidance: the unconditional branch keeps the controls and swaps the text. A control guidance cg != 1 adds a third
  branch, the conditional text without the controls: v_c = v_nc + cg (v_cond - v_nc), then v = v_unc + g (v_c -
  v_unc); cg only where lo < t < hi when an interval is given.
* The prompts: the transfer system prompt, and (`emphasize`) a sentence naming the hints appended to the prompt.

`run_world(..., controls=..., control_source=...)` runs it (`world.py`); this module validates the transfer part
of a request and turns it into the denoising loop's inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .controls import (
    DEFAULT_CONTROL_GUIDANCE,
    ControlHint,
    control_hints,
    control_video,
    normalized_weights,
    video_frames,
)
from .errors import RequestError
from .inputs import bool_field, finite_number
from .vae import FrameEncoder, unit_pixels


@dataclass(frozen=True, eq=False)
class TransferSpec:
    """The validated transfer part of a world request."""

    hints: tuple[ControlHint, ...]  # in sequence order
    source: np.ndarray | None  # uint8 [T, H, W, 3]: what edge / blur are computed from
    control_guidance: float
    control_guidance_interval: tuple[float, float] | None
    emphasize: bool  # append the directive naming the hints to the prompt

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(h.key for h in self.hints)

    def videos(self, height: int, width: int, frames: int) -> list[np.ndarray]:
        """Each control's video for the output: uint8 [frames, height, width, 3] (CPU work: OpenCV, resizes)."""
        return [control_video(h, self.source, height, width, frames) for h in self.hints]


def transfer_spec(controls: Mapping[str, Any] | None, control_source: Any = None, control_guidance: Any = None,
                  control_guidance_interval: Any = None, emphasize_control: Any = True, *,
                  enable_sound: bool = False, num_frames: int = 2
                  ) -> TransferSpec | None:
    """The transfer options of `run_world` -> a `TransferSpec` (None without controls), RequestError naming the
    field otherwise. `control_guidance` None: the single hint's recipe value (1.5 edge / blur / depth, 2.0 seg),
    1 (no third branch) with several hints."""
    if controls is None:
        for name, value in (("control_source", control_source), ("control_guidance", control_guidance),
                            ("control_guidance_interval", control_guidance_interval)):
            if value is not None:
                raise RequestError("is a video transfer option: give controls too", field=name)
        return None
    hints = control_hints(controls)
    if enable_sound:
        raise RequestError("video transfer generates no sound", field="enable_sound")
    if num_frames == 1:
        raise RequestError("video transfer makes videos: num_frames must be > 1", field="num_frames")
    source = None if control_source is None else video_frames(control_source, "control_source")
    if source is not None and not any(h.computed for h in hints):
        raise RequestError("every control has its own video: nothing is computed from a source", field="control_source")
    if control_guidance is None:
        cg = DEFAULT_CONTROL_GUIDANCE[hints[0].key] if len(hints) == 1 else 1.0
    else:
        cg = finite_number(control_guidance, "control_guidance")
        if cg < 0:
            raise RequestError(f"must be >= 0, got {cg}", field="control_guidance")
    interval = None
    if control_guidance_interval is not None:
        value = control_guidance_interval
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2 or any(
                isinstance(v, bool) or not isinstance(v, numbers.Real) for v in value) or not value[0] <= value[1]:
            raise RequestError(f"must be [lo, hi] with lo <= hi (timesteps, 0-1000), got {value!r}",
                               field="control_guidance_interval")
        interval = (float(value[0]), float(value[1]))
    return TransferSpec(hints, source, cg, interval, bool_field(emphasize_control, "emphasize_control"))


@dataclass(frozen=True, eq=False)
class EncodedControls:
    latents: torch.Tensor  # [1, N, C, T, h, w] normalised, on the loop's device
    weights: torch.Tensor  # [1, N] fp32, summing to 1


def encode_controls(spec: TransferSpec, videos: Sequence[np.ndarray], encoder: FrameEncoder,
                    device: torch.device) -> EncodedControls:
    """Control videos uint8 [T, H, W, 3] (`TransferSpec.videos`) -> their latents, each encoded on its own as
    the target's conditioning is (x / 127.5 - 1, the whole clip through the causal VAE)."""
    latents = [encoder.encode(unit_pixels(torch.from_numpy(v)).permute(1, 0, 2, 3)[None]).to(device)
               for v in videos]
    weights = torch.tensor([normalized_weights(spec.hints)], dtype=torch.float32, device=device)
    return EncodedControls(torch.stack(latents, dim=1), weights)
