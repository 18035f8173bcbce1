"""The Reasoner of the MoT checkpoint as a transformers `Qwen3VLForConditionalGeneration`: the key mapping and the
config. Used to build the parity oracle in tests and the in-process baseline of `wamrt bench decode`; the runtime
itself never converts (it runs the checkpoint's own tensors).

Mapping (cosmos-framework's, as the issue states it): the Generator's tensors are dropped; the Reasoner's
`self_attn.to_q/k/v/out` -> `q/k/v/o_proj`, `norm_q/k` -> `q_norm/k_norm`; flat `layers.` / `embed_tokens.` /
`norm.` -> `model.language_model.*`; `lm_head.weight` as is (untied); the vision tower's bare
`Qwen3VLVisionModel` names -> `model.visual.*`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..model import Cosmos3Config

_GENERATOR = re.compile(r"(_moe_gen|\.add_[qkv]_proj\.|\.to_add_out\.|\.norm_added_|\.k_norm_und_for_gen\.)"
                        r"|^(proj_in|proj_out|time_embedder|action_|audio_|norm_moe_gen)")
_RENAMES = ((".self_attn.to_q.", ".self_attn.q_proj."), (".self_attn.to_k.", ".self_attn.k_proj."),
            (".self_attn.to_v.", ".self_attn.v_proj."), (".self_attn.to_out.", ".self_attn.o_proj."),
            (".self_attn.norm_q.", ".self_attn.q_norm."), (".self_attn.norm_k.", ".self_attn.k_norm."))


def qwen3vl_key(name: str) -> str | None:
    """A diffusers-layout transformer key -> its `Qwen3VLForConditionalGeneration` name; None for Generator keys."""
    name = name.removeprefix("model.")
    if _GENERATOR.search(name):
        return None
    if name == "lm_head.weight":
        return name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        return "model.language_model." + name
    raise KeyError(f"no Qwen3-VL name for transformer key {name!r}")


def qwen3vl_state_dict(transformer_state: dict[str, torch.Tensor], lm_head: torch.Tensor,
                       vision_state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in transformer_state.items():
        name = qwen3vl_key(k)
        if name is not None:
            out[name] = v
    out["lm_head.weight"] = lm_head
    for k, v in (vision_state or {}).items():
        out["model.visual." + k] = v
    return out


def qwen3vl_text_config(cfg: Cosmos3Config, vocab: int) -> dict[str, Any]:
    if not cfg.gated_mlp or not cfg.qk_norm_for_text:
        raise ValueError("only the Qwen-stack Reasoner (SiLU MLP, text QK norm: Nano, Super) is a Qwen3-VL text model")
    return dict(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act="silu",
                rms_norm_eps=cfg.rms_norm_eps, attention_bias=cfg.attention_bias, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "mrope_section": list(cfg.rope_axes_dim), "mrope_interleaved": True})


def qwen3vl_config(cfg: Cosmos3Config, vocab: int, vision_config: dict[str, Any] | None = None,
                   token_ids: dict[str, int] | None = None) -> Any:
    """A `Qwen3VLConfig` for the Reasoner of `cfg` (`vision_config`: the vision tower's config dict, None for the
    transformers default, unused by text-only runs)."""
    from transformers import Qwen3VLConfig

    vision = dict(vision_config or {})
    vision.pop("model_type", None)
    vision.pop("architectures", None)
    return Qwen3VLConfig(text_config=qwen3vl_text_config(cfg, vocab), vision_config=vision or None,
                         tie_word_embeddings=False, **(token_ids or {}))
