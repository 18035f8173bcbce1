"""The Cosmos 3 Mixture-of-Transformers and its checkpoint format. Pure model code: no engine,
serving or quantization imports; speed is applied from outside."""

from .attention import AttentionFn, sdpa_attention
from .checkpoint import CheckpointError, init_random_, load_transformer, read_config, save_transformer
from .checkpoint import resolve_folder as resolve_transformer_folder
from .config import CONFIGS, ConfigError, Cosmos3Config, get_config
from .positions import action_positions, generator_offset, sound_positions, text_positions, vision_positions
from .rope import Rope
from .transformer import Cosmos3Transformer, GeneratorOutput, GeneratorTokens, ReasonerKV, stack_reasoner_kv

__all__ = [
    "CONFIGS",
    "AttentionFn",
    "CheckpointError",
    "ConfigError",
    "Cosmos3Config",
    "Cosmos3Transformer",
    "GeneratorOutput",
    "GeneratorTokens",
    "ReasonerKV",
    "Rope",
    "action_positions",
    "generator_offset",
    "get_config",
    "init_random_",
    "load_transformer",
    "read_config",
    "resolve_transformer_folder",
    "save_transformer",
    "sdpa_attention",
    "sound_positions",
    "text_positions",
    "stack_reasoner_kv",
    "vision_positions",
]
