"""Quantization recipes as data: which linear (by qualified module name) gets which format.

A rule is a regular expression matched against the whole module name (`re.fullmatch`) of an
`nn.Linear`; the first matching rule wins and unmatched linears stay in the model dtype. Names are
those of the model after the engine's Generator fusion (`add_qkv_proj`, `gate_up_proj`), and the
unfused names are listed too so a recipe also applies to an unfused model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import RecipeError

FP8_W8A8 = "fp8-w8a8"  # e4m3 weights (per output channel) x e4m3 activations (per token, dynamic)
INT8_W8A16 = "int8-w8a16"  # int8 weights (per output channel), activations stay bf16
FORMATS = (FP8_W8A8, INT8_W8A16)

_LAYER = r"layers\.\d+\."
# Generator tower: attention projections of the added (vision/sound/action) stream and its MLP.
GENERATOR_LINEARS = (
    _LAYER + r"self_attn\.(add_q_proj|add_k_proj|add_v_proj|add_qkv_proj|to_add_out)",
    _LAYER + r"mlp_moe_gen\.(gate_proj|up_proj|gate_up_proj|down_proj)",
)
# The same, every layer but the first: the first layer's Generator input is the freshly embedded noisy latent and
# action rows, which every later layer builds on (on the trained panda-droid, bf16 there cut the open-loop chunk drift
# of gen-fp8 by about a quarter: bench/results/rollout/2026-12-04-00f304e-fp8-gates/).
_AFTER_FIRST = r"layers\.(?!0\.)\d+\."
GENERATOR_LINEARS_AFTER_FIRST = tuple(_AFTER_FIRST + p[len(_LAYER):] for p in GENERATOR_LINEARS)
# Reasoner tower: text-stream attention projections and MLP.
REASONER_LINEARS = (
    _LAYER + r"self_attn\.(to_q|to_k|to_v|to_out)",
    _LAYER + r"mlp\.(gate_proj|up_proj|down_proj)",
)
# Never quantized, whatever a recipe says: these are small (no speed to gain) and sit where errors
# are not averaged away (inputs/outputs of the stack, the time conditioning, per-domain action heads).
PROTECTED = (
    r"embed_tokens", r"proj_in", r"proj_out", r"time_embedder\..*", r"action_proj_(in|out)(\..*)?",
    r"audio_proj_(in|out)", r".*norm.*",
)


@dataclass(frozen=True)
class Rule:
    pattern: str  # re.fullmatch against the qualified module name
    fmt: str

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise RecipeError(f"unknown format {self.fmt!r}; known: {list(FORMATS)}")
        re.compile(self.pattern)


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[Rule, ...]
    description: str = ""
    # Quantize after the engine's Generator fusion: q/k/v (and gate/up) then share one activation
    # quantization and one fp8 GEMM, and the engine's own fuse pass becomes a no-op.
    fused: bool = True
    lossy: bool = field(default=True, repr=False)

    def format_of(self, name: str) -> str | None:
        for rule in self.rules:
            if re.fullmatch(rule.pattern, name):
                if any(re.fullmatch(p, name) for p in PROTECTED):
                    raise RecipeError(
                        f"recipe {self.name!r} rule {rule.pattern!r} selects protected module {name}")
                return rule.fmt
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "fused": self.fused,
                "rules": [{"pattern": r.pattern, "format": r.fmt} for r in self.rules]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Recipe:
        rules = tuple(Rule(r["pattern"], r["format"]) for r in raw["rules"])
        return cls(raw["name"], rules, raw.get("description", ""), bool(raw.get("fused", True)))


def _rules(patterns: tuple[str, ...], fmt: str) -> tuple[Rule, ...]:
    return tuple(Rule(p, fmt) for p in patterns)


RECIPES: dict[str, Recipe] = {
    "gen-fp8": Recipe(
        "gen-fp8", _rules(GENERATOR_LINEARS, FP8_W8A8),
        "Generator-tower linears FP8 e4m3 W8A8; Reasoner, embeddings, projections, norms untouched",
    ),
    "gen-fp8-skip-first": Recipe(
        "gen-fp8-skip-first", _rules(GENERATOR_LINEARS_AFTER_FIRST, FP8_W8A8),
        "gen-fp8 with the first layer's Generator linears left in the model dtype",
    ),
    "gen-fp8+reasoner-w8": Recipe(
        "gen-fp8+reasoner-w8", _rules(GENERATOR_LINEARS, FP8_W8A8) + _rules(REASONER_LINEARS, INT8_W8A16),
        "gen-fp8 plus Reasoner linears int8 weight-only (per-channel scales)",
    ),
    "all-fp8": Recipe(
        "all-fp8", _rules(GENERATOR_LINEARS + REASONER_LINEARS, FP8_W8A8),
        "every transformer-layer linear of both towers FP8 e4m3 W8A8 (for comparison)",
    ),
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise RecipeError(f"unknown recipe {recipe!r}; known: {sorted(RECIPES)}") from None
