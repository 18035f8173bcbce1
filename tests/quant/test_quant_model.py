"""A quantized tiny model still runs the whole forward, close to the unquantized one.

Tolerance: relative L2 <= 0.12 on the action and vision velocities vs the fp32 unquantized model.
Each fp8 linear adds independent ~-28.5 dB noise (~4% relative; measured 27.8-30.6 dB per layer);
over the tiny model's 2 layers this lands at 4-6.5% on the outputs (measured over seeds 0-3, every
recipe, both flavours). 0.12 leaves ~2x margin yet fails when every weight scale is off by 25% (a
quantizer bug); a single bad layer is diluted by the residual stream, which is why the per-layer SQNR
table, not this output check, is the gate for individual layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from oracle.quant_models import policy_inputs, rel_l2, tiny_model

from wamrt.engine.fuse import FusedGateUp, FusedGeneratorQKV, fuse_generator
from wamrt.quant import RECIPES, Fp8Linear, quantize_model, quantized_modules, set_kernel

REL_L2_TOL = 0.12


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantized_forward_is_close_to_unquantized(flavour, recipe):
    ref = tiny_model(flavour, seed=1)
    quant = copy.deepcopy(ref)
    quantize_model(quant, recipe, kernel="reference")
    ids, pos, tok = policy_inputs(ref, 1)
    a, b = ref(ids, pos, tok), quant(ids, pos, tok)
    for what in ("action", "vision"):
        err = rel_l2(getattr(b, what), getattr(a, what))
        assert 1e-3 < err <= REL_L2_TOL, f"{what}: {err:.4f}"  # > 1e-3: quantization really happened
    # Clean frame 0 stays exactly zero velocity.
    assert torch.equal(b.vision[:, :, 0], torch.zeros_like(b.vision[:, :, 0]))


def test_broken_scale_is_visible_at_the_output():
    ref = tiny_model(seed=1)
    quant = copy.deepcopy(ref)
    quantize_model(quant, "gen-fp8", kernel="reference")
    for m in quantized_modules(quant).values():
        m.weight_scale.mul_(1.25)
    ids, pos, tok = policy_inputs(ref, 1)
    assert rel_l2(quant(ids, pos, tok).action, ref(ids, pos, tok).action) > REL_L2_TOL


def test_fused_and_unfused_quantization_agree(flavour):
    ref = tiny_model(flavour, seed=2)
    fused, unfused = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(fused, "gen-fp8", kernel="reference")
    quantize_model(unfused, "gen-fp8", kernel="reference", fuse=False)
    ids, pos, tok = policy_inputs(ref, 2)
    a, b = fused(ids, pos, tok).action, unfused(ids, pos, tok).action
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_fusion_is_a_no_op_on_a_quantized_model():
    model = tiny_model()
    quantize_model(model, "gen-fp8")
    before = dict(model.named_modules())
    fuse_generator(model)
    assert dict(model.named_modules()) == before
    layer = model.layers[0]
    assert isinstance(layer.self_attn, FusedGeneratorQKV) and isinstance(layer.mlp_moe_gen, FusedGateUp)
    assert isinstance(layer.self_attn.add_qkv_proj, Fp8Linear) and layer.self_attn.add_q_proj is None


def test_split_reasoner_generator_path_and_bf16():
    """The engine's path (prefill once, Generator per step) in bf16 agrees with the full forward."""
    model = tiny_model(seed=4, dtype=torch.bfloat16)
    quantize_model(model, "gen-fp8+reasoner-w8")
    set_kernel(model, "reference")
    ids, pos, tok = policy_inputs(model, 4)
    full = model(ids, pos, tok)
    rope_und, rope_gen = model.rope(pos).split(ids.shape[1])
    kv = model.prefill_reasoner(ids, rope_und)
    step = model.generator_step(tok, rope_gen, kv)
    assert full.action.dtype == torch.bfloat16
    torch.testing.assert_close(step.action, full.action, rtol=0, atol=0)
