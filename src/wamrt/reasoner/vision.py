"""Images and video frames into the Nano / Super Reasoner through transformers' Qwen3-VL vision tower.

The tower is transformers' `Qwen3VLVisionModel` itself (patch embed, ViT blocks, merger, DeepStack mergers), built
from the checkpoint's `vision_encoder/config.json` and loaded from its shards (`load_vision_tower`). Images are
prepared by transformers' Qwen2-VL image processor (the one Qwen3-VL ships with, here its Pillow backend: resize
to a multiple of patch x merge within the pixel budget, normalise, cut into patches).

Videos follow `Qwen3VLVideoProcessor`, whose own class needs torchvision (not a dependency here): the same frame
sampling (uniform at `fps` frames per second, 4..768 frames), transformers' video `smart_resize` for the size, a
Pillow bicubic resize per frame, the same patch layout (two consecutive frames per temporal patch, the last frame
repeated to fill one) and the timestamps its processor writes before every temporal patch (the mean time of its
two frames, "<1.2 seconds>").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..pipeline.errors import RequestError

# Qwen3-VL's preprocessor_config.json / video_preprocessor_config.json values (used when the checkpoint ships none).
IMAGE_PROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
VIDEO_PROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2.0, "min_frames": 4,
                   "max_frames": 768, "size": {"shortest_edge": 4096, "longest_edge": 25165824}}


@dataclass
class MediaInput:
    """One image or video as the tower takes it: patches [N, C * tp * p * p], grid (t, h, w) in patches."""

    kind: str  # "image" | "video"
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamps: list[float] | None = None  # video: seconds of every temporal patch

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // merge**2


def load_vision_tower(config: dict[str, Any], shards: Sequence[Path], *, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> Any:
    """A `Qwen3VLVisionModel` of `config` (the vision_encoder/config.json dict) with its weights read from `shards`.
    Keys are the bare tower names (`patch_embed.proj.weight`, `blocks.0...`); a `visual.` / `model.visual.` /
    `vision_encoder.` prefix is accepted. Every tower tensor must be there, and nothing else of the tower."""
    from safetensors import safe_open
    from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}
    cfg = Qwen3VLVisionConfig(**fields)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with torch.device(device), no_init_weights():
        tower = Qwen3VLVisionModel(cfg)
    expected = tower.state_dict()
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key
                for prefix in ("vision_encoder.", "model.visual.", "visual."):
                    name = name.removeprefix(prefix)
                if name in expected:
                    state[name] = f.get_tensor(key)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"vision tower tensors missing from {[str(s) for s in shards]}: {missing[:6]}"
                         + (f" ... ({len(missing)} in all)" if len(missing) > 6 else ""))
    tower.load_state_dict(state, strict=True)
    return tower.to(device=device, dtype=dtype).eval().requires_grad_(False)


class VisionTower:
    """The vision tower plus its processors' settings; `max_pixels` caps the pixels one image (one video frame) is
    resized to, so the media tokens of a request are bounded before any pixel is processed."""

    def __init__(self, model: Any, image_processor: dict[str, Any] | None = None,
                 video_processor: dict[str, Any] | None = None, *, max_pixels: int | None = None) -> None:
        cfg = model.config
        self.model, self.patch, self.merge = model, int(cfg.patch_size), int(cfg.spatial_merge_size)
        self.temporal = int(cfg.temporal_patch_size)
        self.image_cfg = {**IMAGE_PROCESSOR, **(image_processor or {})}
        self.video_cfg = {**VIDEO_PROCESSOR, **(video_processor or {})}
        if max_pixels is not None:
            for c in (self.image_cfg, self.video_cfg):
                c["size"] = {**c["size"], "longest_edge": min(int(c["size"]["longest_edge"]), int(max_pixels))}
        self.out_hidden = int(cfg.out_hidden_size)
        self.deepstack_layers = len(cfg.deepstack_visual_indexes)

    @classmethod
    def from_folder(cls, folder: Path, shards: Sequence[Path] | None = None, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, max_pixels: int | None = None,
                    image_processor: dict[str, Any] | None = None, video_processor: dict[str, Any] | None = None
                    ) -> VisionTower:
        """`folder` = the checkpoint's vision_encoder/ (config.json, safetensors, optional processor configs next to
        it or in the checkpoint root, which `image_processor` / `video_processor` override); `shards` default to the
        folder's own *.safetensors."""
        config = json.loads((folder / "config.json").read_text())
        files = list(shards) if shards is not None else sorted(folder.glob("*.safetensors"))
        procs = []
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            found = next((p for p in (folder / name, folder.parent / name) if p.is_file()), None)
            procs.append(_processor_fields(json.loads(found.read_text())) if found else {})
        return cls(load_vision_tower(config, files, device=device, dtype=dtype),
                   {**procs[0], **(image_processor or {})}, {**procs[1], **(video_processor or {})},
                   max_pixels=max_pixels)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # Inputs --------------------------------------------------------------------------------------------------------
    def image(self, image: Any) -> MediaInput:
        """A PIL image -> patches (transformers' Qwen2-VL image processor, Pillow backend)."""
        processor = _image_processor(self.patch, self.merge, self.temporal, self.image_cfg)
        out = processor(images=[image.convert("RGB")], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return MediaInput("image", out["pixel_values"], (t, h, w))

    def video(self, frames: np.ndarray, fps: float) -> MediaInput:
        """frames [T, H, W, 3] uint8 at `fps` -> patches of the sampled frames and their timestamps."""
        from PIL import Image

        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise RequestError(f"a video must be [T, H, W, 3] uint8 frames, got {frames.shape} {frames.dtype}",
                               field="video")
        c, total = self.video_cfg, frames.shape[0]
        n = min(max(int(total / fps * float(c["fps"])), int(c["min_frames"])), int(c["max_frames"]), total)
        indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
        height, width = frames.shape[1:3]
        rh, rw = video_size(len(indices), height, width, self.patch * self.merge, self.temporal, c["size"])
        picked = [np.asarray(Image.fromarray(frames[i]).resize((rw, rh), Image.Resampling.BICUBIC)) for i in indices]
        video = torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2).float() / 255.0  # [T, C, H, W]
        mean = torch.tensor(c["image_mean"]).view(1, 3, 1, 1)
        std = torch.tensor(c["image_std"]).view(1, 3, 1, 1)
        video = (video - mean) / std
        if pad := -video.shape[0] % self.temporal:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        p, m, tp = self.patch, self.merge, self.temporal
        gt, gh, gw = video.shape[0] // tp, rh // p, rw // p
        patches = video.view(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return MediaInput("video", patches.reshape(gt * gh * gw, 3 * tp * p * p), (gt, gh, gw),
                          frame_timestamps(indices, fps, tp))

    # Encoding ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, media: Sequence[MediaInput]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Media of one kind, encoded together as transformers does -> (embeddings [N, out], DeepStack features,
        one [N, out] per DeepStack layer)."""
        pixels = torch.cat([m.pixel_values for m in media]).to(self.device, next(self.model.parameters()).dtype)
        grid = torch.tensor([m.grid_thw for m in media], device=self.device)
        out = self.model(pixels, grid_thw=grid)
        if isinstance(out, tuple):  # transformers before the output dataclass: (merged, deepstack list)
            return out[0], list(out[1])
        return out.pooler_output, list(out.deepstack_features)


def video_size(frames: int, height: int, width: int, factor: int, temporal: int, size: dict[str, int]
               ) -> tuple[int, int]:
    """Qwen3-VL's video `smart_resize` (transformers' own function)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    try:
        return smart_resize(max(frames, temporal), height, width, temporal_factor=temporal, factor=factor,
                            min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]))
    except ValueError as exc:
        raise RequestError(str(exc), field="video") from exc


def frame_timestamps(indices: Sequence[int], fps: float, temporal: int) -> list[float]:
    """Seconds of every temporal patch, as `Qwen3VLProcessor` writes them: frames padded to a whole patch by
    repeating the last index, then the mean time of each patch's first and last frame."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal)
    times = [i / fps for i in idx]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def _processor_fields(raw: dict[str, Any]) -> dict[str, Any]:
    out = {k: raw[k] for k in ("image_mean", "image_std", "fps", "min_frames", "max_frames") if k in raw}
    size = dict(raw.get("size") or {})
    if "min_pixels" in raw:
        size.setdefault("shortest_edge", raw["min_pixels"])
    if "max_pixels" in raw:
        size.setdefault("longest_edge", raw["max_pixels"])
    if size.get("shortest_edge") and size.get("longest_edge"):
        out["size"] = {"shortest_edge": int(size["shortest_edge"]), "longest_edge": int(size["longest_edge"])}
    return out


def _image_processor(patch: int, merge: int, temporal: int, cfg: dict[str, Any]) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers without the Pillow backend classes (it has torchvision then)
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor(patch_size=patch, merge_size=merge, temporal_patch_size=temporal, image_mean=cfg["image_mean"],
                     image_std=cfg["image_std"], size=dict(cfg["size"]))
