"""Module selection: which linears each recipe quantizes, and which it must never touch."""

from __future__ import annotations

import re

import pytest
import torch
from oracle.quant_models import tiny_model
from torch import nn

from wamrt.quant import (
    FP8_W8A8,
    INT8_W8A16,
    RECIPES,
    Recipe,
    RecipeError,
    Rule,
    get_recipe,
    quantize_model,
    select_modules,
)

GEN = re.compile(r"layers\.\d+\.(self_attn\.(add_\w+|to_add_out)|mlp_moe_gen\.\w+)")
REASONER = re.compile(r"layers\.\d+\.(self_attn\.(to_q|to_k|to_v|to_out)|mlp\.\w+)")
# Everything that is not a transformer-layer linear of either tower.
NEVER = ("embed_tokens", "proj_in", "proj_out", "time_embedder", "action_proj_in", "action_proj_out", "norm")


def linears(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def test_gen_fp8_selects_exactly_the_generator_linears(flavour):
    model = tiny_model(flavour)
    chosen = select_modules(model, "gen-fp8")
    per_layer = 7 if model.config.gated_mlp else 6  # q, k, v, out + (gate), up, down
    assert len(chosen) == per_layer * model.config.num_hidden_layers
    assert set(chosen) == {n for n in linears(model) if GEN.fullmatch(n)}
    assert set(chosen.values()) == {FP8_W8A8}


def test_gen_fp8_skip_first_leaves_exactly_the_first_layer(flavour):
    model = tiny_model(flavour)
    assert model.config.num_hidden_layers >= 2
    every = select_modules(model, "gen-fp8")
    chosen = select_modules(model, "gen-fp8-skip-first")
    assert set(every) - set(chosen) == {n for n in every if n.startswith("layers.0.")} != set()
    assert set(chosen) == {n for n in every if not n.startswith("layers.0.")}
    # only the first layer is left out, not layers whose index merely contains a 0
    recipe = RECIPES["gen-fp8-skip-first"]
    for layer, fmt in (("0", None), ("1", FP8_W8A8), ("10", FP8_W8A8), ("20", FP8_W8A8), ("30", FP8_W8A8)):
        assert recipe.format_of(f"layers.{layer}.mlp_moe_gen.down_proj") == fmt, layer


def test_fused_names_are_selected_after_fusion(flavour):
    model = tiny_model(flavour)
    chosen = quantize_model(model, "gen-fp8")
    names = {n.split(".", 2)[2] for n in chosen}
    expected = {"self_attn.add_qkv_proj", "self_attn.to_add_out", "mlp_moe_gen.down_proj"}
    expected |= {"mlp_moe_gen.gate_up_proj"} if model.config.gated_mlp else {"mlp_moe_gen.up_proj"}
    assert names == expected


def test_reasoner_w8_and_all_fp8(flavour):
    model = tiny_model(flavour)
    mixed = select_modules(model, "gen-fp8+reasoner-w8")
    reasoner = {n for n in linears(model) if REASONER.fullmatch(n)}
    assert {n for n, f in mixed.items() if f == INT8_W8A16} == reasoner
    assert {n for n, f in mixed.items() if f == FP8_W8A8} == set(select_modules(model, "gen-fp8"))
    every = select_modules(model, "all-fp8")
    assert set(every) == set(mixed) and set(every.values()) == {FP8_W8A8}
    # Every layer linear is covered by all-fp8; what is left over are exactly the protected modules.
    assert all(any(k in n for k in NEVER) for n in linears(model) - set(every))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_protected_modules_are_never_touched(recipe):
    model = tiny_model("tiny-qwen")
    protected = [n for n, _ in model.named_modules()
                 if n and any(n.startswith(k) or k in n.split(".")[-1] for k in NEVER)]
    mods = {n: model.get_submodule(n) for n in protected}
    before = {n: (type(m), {k: v.clone() for k, v in m.state_dict().items()}) for n, m in mods.items()}
    assert before, "the fixture should have protected modules"
    chosen = quantize_model(model, recipe)
    assert not [n for n in chosen if any(k in n for k in NEVER)]
    for n, (cls, state) in before.items():
        mod = model.get_submodule(n)
        assert type(mod) is cls, n
        for k, v in mod.state_dict().items():
            assert torch.equal(v, state[k]), f"{n}.{k}"


def test_a_rule_reaching_a_protected_module_is_refused():
    bad = Recipe("bad", (Rule(r"proj_in", FP8_W8A8),))
    with pytest.raises(RecipeError, match="protected module proj_in"):
        select_modules(tiny_model(), bad)


def test_unknown_recipe_and_format():
    with pytest.raises(RecipeError, match="unknown recipe"):
        get_recipe("gen-fp4")
    with pytest.raises(RecipeError, match="unknown format"):
        Rule(r"x", "fp4")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_dict_round_trip(recipe):
    r = RECIPES[recipe]
    assert Recipe.from_dict(r.to_dict()) == r


def test_quantizing_twice_is_refused():
    model = tiny_model()
    quantize_model(model, "gen-fp8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "all-fp8")
