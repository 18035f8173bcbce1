"""Cosmos 3 transformer configuration and the registry of known sizes.

Field names follow the diffusers 0.42.1 `Cosmos3OmniTransformer` config.json so that a checkpoint's
config loads with no renaming.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "relu2")


class ConfigError(ValueError):
    """A config.json that this runtime cannot build a model from."""


@dataclass(frozen=True)
class Cosmos3Config:
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)
    vocab_size: int = 151936
    latent_channel: int = 48
    latent_patch_size: int = 2
    patch_latent_dim: int = 192
    base_fps: int = 24
    enable_fps_modulation: bool = True
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    timestep_scale: float = 0.001
    action_gen: bool = False
    action_dim: int | None = None
    num_embodiment_domains: int = 32
    sound_gen: bool = False
    sound_dim: int | None = None
    sound_latent_fps: float = 25.0
    # Sizes of the sinusoidal timestep features fed to the time MLP (fixed by the architecture).
    time_proj_dim: int = field(default=256, repr=False)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 or sum(self.rope_axes_dim) != self.head_dim // 2:
            raise ConfigError(
                f"rope_axes_dim {list(self.rope_axes_dim)} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        expected_patch = self.latent_patch_size**2 * self.latent_channel
        if self.patch_latent_dim != expected_patch:
            raise ConfigError(f"patch_latent_dim must be {expected_patch}, got {self.patch_latent_dim}")
        if self.action_gen and not self.action_dim:
            raise ConfigError("action_gen=True needs action_dim")
        if self.sound_gen and not self.sound_dim:
            raise ConfigError("sound_gen=True needs sound_dim")

    # Derived views ---------------------------------------------------------------------------------
    @property
    def nemotron_norm(self) -> bool:
        """relu2 checkpoints (Edge) use the all-fp32 Nemotron RMSNorm everywhere."""
        return self.hidden_act == "relu2"

    @property
    def gated_mlp(self) -> bool:
        return self.hidden_act == "silu"

    @property
    def has_und_k_norm_for_gen(self) -> bool:
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> Cosmos3Config:
        return dataclasses.replace(self, **changes)

    # diffusers config.json round trip -------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Cosmos3Config:
        """Build from a diffusers config.json dict; unknown bookkeeping keys (`_class_name`...) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        axes = raw.get("rope_axes_dim")
        if axes is None:
            scaling = raw.get("rope_scaling") or {}
            axes = scaling.get("mrope_section", [24, 20, 20])
        kwargs["rope_axes_dim"] = tuple(int(a) for a in axes)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("time_proj_dim")
        out["rope_axes_dim"] = list(self.rope_axes_dim)
        return out


_ACTION = dict(action_gen=True, action_dim=64, num_embodiment_domains=32)

# Real sizes (cosmos3_spec.md section 2). Edge: Nemotron dense text stack; Nano/Super: Qwen3-VL text stack.
CONFIGS: dict[str, Cosmos3Config] = {
    "edge": Cosmos3Config(
        hidden_size=2048, intermediate_size=9216, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, hidden_act="relu2", qk_norm_for_text=False,
        use_und_k_norm_for_gen=True, rope_theta=1e8, rms_norm_eps=1e-5, vocab_size=131072, **_ACTION,
    ),
    "nano": Cosmos3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", rope_theta=5e6, rms_norm_eps=1e-6,
        vocab_size=151936, **_ACTION,
    ),
    "super": Cosmos3Config(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", rope_theta=5e6, rms_norm_eps=1e-6,
        vocab_size=151936, **_ACTION,
    ),
    # Tiny test sizes of both flavours (CPU parity tests, the embedded demo model).
    "tiny-qwen": Cosmos3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_axes_dim=(4, 2, 2), hidden_act="silu", rope_theta=5e6,
        rms_norm_eps=1e-6, vocab_size=512, **_ACTION,
    ),
    "tiny-edge": Cosmos3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_axes_dim=(4, 2, 2), hidden_act="relu2",
        qk_norm_for_text=False, use_und_k_norm_for_gen=True, rope_theta=1e8, rms_norm_eps=1e-5,
        vocab_size=512, **_ACTION,
    ),
    # The small policy trained in-repo on the simulator (wamrt.train; the embedded `panda-droid` model):
    # Qwen flavour, small enough to serve on a CPU (~0.8 s per 4-step CFG request on 2 cores at tier 256).
    "policy-s": Cosmos3Config(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, rope_axes_dim=(12, 10, 10), hidden_act="silu", rope_theta=5e6,
        rms_norm_eps=1e-6, vocab_size=512, **_ACTION,
    ),
}


def get_config(name: str) -> Cosmos3Config:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown model size {name!r}; known: {sorted(CONFIGS)}") from None
