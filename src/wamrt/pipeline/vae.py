"""Wan2.2 VAE (diffusers `AutoencoderKLWan`) used as the conditioning encoder.

Wan2.2 is causal in time, so latent frame 0 depends on pixel frame 0 only: encoding that one frame
gives the exact conditioning latent that the reference gets from encoding the whole clip, at ~1/25
of the cost. Policies never decode; forward dynamics may.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from safetensors import safe_open

from ..model.checkpoint import CheckpointError, read_json_object, weight_files
from .canvas import pad_unit_pixels
from .errors import RequestError
from .geometry import CanvasGeometry

# Per-channel statistics of Wan2.2 (TI2V-5B) latents: data constants of the released VAE, which the
# checkpoints were trained with (also in its diffusers config.json).
WAN22_LATENT_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.157, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENT_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)


class VaeError(CheckpointError):
    """A VAE folder that cannot be loaded, or whose config disagrees with its weights; one line naming the file
    and the field."""


def check_vae_config(cfg: dict[str, Any], cfg_path: Path) -> None:
    """The latent statistics must have one finite entry per latent channel (std > 0): a config whose
    `latents_mean` does not match `z_dim` would otherwise fail deep inside the first encode."""
    z_dim = cfg.get("z_dim")
    if not isinstance(z_dim, int) or z_dim < 1:
        raise VaeError(f"must be a positive integer, got {z_dim!r}", file=cfg_path, field="z_dim")
    for name in ("latents_mean", "latents_std"):
        values = cfg.get(name)
        if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
            raise VaeError(f"must be a list of {z_dim} numbers, got {type(values).__name__}", file=cfg_path,
                           field=name)
        if len(values) != z_dim:
            raise VaeError(f"has {len(values)} entries but z_dim is {z_dim}", file=cfg_path, field=name)
        if not all(math.isfinite(v) for v in values) or (name == "latents_std" and min(values) <= 0):
            raise VaeError("must be finite" + (" and > 0" if name == "latents_std" else ""), file=cfg_path,
                           field=name)


def read_vae_config(folder: str | Path) -> dict[str, Any]:
    """The VAE folder's config.json (diffusers' bookkeeping `_` keys dropped), checked by `check_vae_config`."""
    cfg_path = Path(folder) / "config.json"
    raw = read_json_object(cfg_path, "VAE config", VaeError)
    cfg = {k: v for k, v in raw.items() if not k.startswith("_")}
    check_vae_config(cfg, cfg_path)
    return cfg


def load_vae(folder: str | Path, *, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> AutoencoderKLWan:
    """Load a diffusers-layout VAE folder: config.json + diffusion_pytorch_model.safetensors, or shards listed
    by a `*.safetensors.index.json` (what `save_pretrained(max_shard_size=...)` writes)."""
    folder = Path(folder)
    cfg_path, cfg = folder / "config.json", read_vae_config(folder)
    files = weight_files(folder, required=False)
    if not files:
        raise VaeError("no safetensors weights (diffusion_pytorch_model.safetensors or an index)", file=folder)
    try:
        vae = AutoencoderKLWan.from_config(cfg)
    except (TypeError, ValueError, RuntimeError) as e:
        raise VaeError(f"AutoencoderKLWan cannot be built from it ({e})", file=cfg_path) from e
    expected = vae.state_dict()
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise VaeError("shard file is missing", file=file)
        with safe_open(str(file), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise VaeError(f"the index lists tensor {name!r} but the file lacks it", file=file)
                if name not in expected:
                    raise VaeError(f"unexpected tensor {name!r} (not a parameter of this config)", file=file)
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise VaeError(f"tensor {name!r} has shape {list(tensor.shape)}, the config makes it "
                                   f"{list(expected[name].shape)}", file=file)
                state[name] = tensor
    missing = sorted(set(expected) - set(state))
    if missing:
        raise VaeError(f"missing tensors: {', '.join(missing[:8])}" + (f", ... ({len(missing)} in all)"
                                                                        if len(missing) > 8 else ""), file=folder)
    vae.load_state_dict(state, strict=True)
    # nn.Module.to: diffusers' override warns about fp32-kept modules, of which this VAE has none.
    return torch.nn.Module.to(vae, device=device, dtype=dtype).eval().requires_grad_(False)


class FrameEncoder:
    """Pixels of one frame -> normalised latent, (mu - mean) * (1 / std) with the VAE's constants."""

    def __init__(self, vae: AutoencoderKLWan) -> None:
        self.vae = vae
        dtype = vae.dtype
        self.mean = torch.tensor(vae.config.latents_mean, dtype=dtype, device=vae.device).view(1, -1, 1, 1, 1)
        self.inv_std = (1.0 / torch.tensor(vae.config.latents_std, dtype=dtype)).to(vae.device).view(1, -1, 1, 1, 1)
        self.spatial = int(vae.config.scale_factor_spatial)
        self.temporal = int(vae.config.scale_factor_temporal)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, T, H, W] in [-1, 1] (T = 1 for a conditioning frame) -> fp32 [B, C, T', H/16, W/16]."""
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise RequestError(f"VAE input must be [B, 3, T, H, W], got {tuple(pixels.shape)}")
        h, w = pixels.shape[-2:]
        if h % self.spatial or w % self.spatial:
            raise RequestError(f"VAE input size {h}x{w} must be a multiple of {self.spatial}")
        x = pixels.to(device=self.vae.device, dtype=self.vae.dtype)
        mu = self.vae.encode(x).latent_dist.mode()
        return ((mu - self.mean) * self.inv_std).float()

    def encode_uint8(self, frames: torch.Tensor) -> torch.Tensor:
        """frames uint8 [B, H, W, 3] -> latent of each as a single frame, [B, C, 1, H/16, W/16]."""
        return self.encode(unit_pixels(frames)[:, :, None])

    def encode_content_uint8(self, content: torch.Tensor, geometry: CanvasGeometry) -> torch.Tensor:
        """content uint8 [B, content_h, content_w, 3] (canvases before their bucket pad, `PaddedCanvas.content`) ->
        the latent of each padded canvas as a single frame: `encode_uint8` of the padded pixels, the pad done on
        the content's device."""
        check_content(content, geometry)
        return self.encode(pad_unit_pixels(unit_pixels(content), geometry)[:, :, None])


def check_content(content: torch.Tensor, geometry: CanvasGeometry) -> None:
    """A RequestError unless content is uint8 [B, content_h, content_w, 3] for this geometry."""
    if content.dtype != torch.uint8 or content.ndim != 4 or content.shape[1:] != (
            geometry.content_h, geometry.content_w, 3):
        raise RequestError(f"expected uint8 [B, {geometry.content_h}, {geometry.content_w}, 3] canvas content for "
                           f"its geometry, got {content.dtype} {tuple(content.shape)}")


def unit_pixels(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, 3, H, W] in [-1, 1] (x / 127.5 - 1, as the framework does)."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise RequestError(f"expected uint8 [B, H, W, 3] frames, got {frames.dtype} {tuple(frames.shape)}")
    return frames.permute(0, 3, 1, 2).float() / 127.5 - 1.0
