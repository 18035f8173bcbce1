"""The Cosmos 3 sound tokenizer (diffusers `Cosmos3AVAEAudioTokenizer`) as the decoder of sound latents.

Sound is generated jointly with the video as [sound_dim, T] latents at `sound_latent_fps`; only the
tokenizer's decoder is needed to turn them into a waveform. Its sampling rate and hop size also fix
how many latent frames a clip of a given duration has.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer
from safetensors.torch import load_file

from .errors import RequestError


class SoundTokenizerError(ValueError):
    """A sound tokenizer folder that cannot be loaded."""


def load_sound_tokenizer(folder: str | Path, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> Cosmos3AVAEAudioTokenizer:
    """Load a diffusers-layout `sound_tokenizer` folder (config.json + diffusion_pytorch_model.safetensors).

    Decoder-only weights (the released checkpoints ship no encoder) build a decoder-only tokenizer.
    """
    folder = Path(folder)
    cfg_path, weights = folder / "config.json", folder / "diffusion_pytorch_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise SoundTokenizerError(f"{folder}: expected config.json and diffusion_pytorch_model.safetensors")
    state = load_file(str(weights))
    cfg = {k: v for k, v in json.loads(cfg_path.read_text()).items() if not k.startswith("_")}
    cfg["encoder_enabled"] = any(k.startswith("encoder.") for k in state)
    tokenizer = Cosmos3AVAEAudioTokenizer.from_config(cfg)
    try:
        tokenizer.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SoundTokenizerError(f"{weights}: {e}") from e
    return torch.nn.Module.to(tokenizer, device=device, dtype=dtype).eval().requires_grad_(False)


class SoundDecoder:
    """Sound latents [sound_dim, T] -> waveform [channels, samples] in [-1, 1]."""

    def __init__(self, tokenizer: Cosmos3AVAEAudioTokenizer) -> None:
        self.tokenizer = tokenizer
        self.sampling_rate = int(tokenizer.config.sampling_rate)
        self.hop_size = int(tokenizer._hop_size)  # waveform samples per latent frame
        self.latent_channels = int(tokenizer.config.vocoder_input_dim)

    def latent_frames(self, num_frames: int, fps: float) -> int:
        """Sound latent frames of a clip of `num_frames` video frames at `fps` (the reference's count:
        whole samples of the clip's duration, then a ceiling division by the hop size)."""
        samples = int(num_frames / fps * self.sampling_rate)
        return -(-samples // self.hop_size)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [S, T] (or [1, S, T]) -> float32 [channels, samples] on the CPU."""
        if latents.ndim == 3:
            if latents.shape[0] != 1:
                raise RequestError(f"decodes one clip at a time, got {tuple(latents.shape)}", field="sound")
            latents = latents[0]
        if latents.ndim != 2 or latents.shape[0] != self.latent_channels:
            raise RequestError(
                f"expected [{self.latent_channels}, T] sound latents, got {tuple(latents.shape)}", field="sound"
            )
        param = next(self.tokenizer.parameters())
        waveform = self.tokenizer.decode(latents[None].to(device=param.device, dtype=param.dtype))  # [1, ch, N]
        return waveform[0].float().cpu()
