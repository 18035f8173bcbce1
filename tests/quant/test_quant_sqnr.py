"""Per-layer SQNR tooling on a tiny random model: every swapped linear clears 25 dB, and the check
fails when a scale is deliberately broken."""

from __future__ import annotations

import copy

import pytest
from oracle.quant_models import policy_inputs, tiny_model

from wamrt.quant import (
    RECIPES,
    failing,
    format_table,
    layer_sqnr,
    quantize_model,
    quantized_modules,
    unexercised,
)
from wamrt.quant.sqnr import SQNR_BAR_DB


def measured(flavour: str, recipe: str, seed: int = 0):
    ref = tiny_model(flavour, seed=seed)
    quant = copy.deepcopy(ref)
    quantize_model(quant, recipe, kernel="reference")
    ids, pos, tok = policy_inputs(ref, seed)
    return ref, quant, lambda m: m(ids, pos, tok)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_swapped_linear_clears_the_bar(flavour, recipe):
    ref, quant, run = measured(flavour, recipe)
    rows = layer_sqnr(ref, quant, run)  # reference unfused, quantized fused: parts are concatenated
    assert [r.name for r in rows] == list(quantized_modules(quant))
    assert not failing(rows), format_table(rows)
    assert min(r.sqnr_db for r in rows if r.calls) >= SQNR_BAR_DB
    # The last layer's Reasoner output projection and MLP never run (nothing reads their output).
    last = ref.config.num_hidden_layers - 1
    assert all(r.name.startswith(f"layers.{last}.") and ".mlp." in r.name or r.name.endswith(".to_out")
               for r in unexercised(rows))
    if recipe == "gen-fp8":
        assert not unexercised(rows)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "**NO**" not in table


def test_a_broken_scale_fails_the_bar():
    ref, quant, run = measured("tiny-qwen", "gen-fp8")
    victim = "layers.1.mlp_moe_gen.down_proj"
    quant.get_submodule(victim).weight_scale.mul_(1.25)  # a 25% dequantization gain error
    rows = layer_sqnr(ref, quant, run)
    bad = failing(rows)
    assert [r.name for r in bad] == [victim]
    assert bad[0].sqnr_db < SQNR_BAR_DB
    assert "**NO**" in format_table(rows)


def test_sqnr_accumulates_over_calls():
    ref, quant, run = measured("tiny-qwen", "gen-fp8")
    once = layer_sqnr(ref, quant, run)
    twice = layer_sqnr(ref, quant, lambda m: (run(m), run(m)))
    for a, b in zip(once, twice, strict=True):
        assert b.calls == 2 * a.calls
        assert abs(a.sqnr_db - b.sqnr_db) < 1e-9
