"""The fused-epilogue layer tail (engine/epilogues.py). CPU: the reference dataflow (interleaved gate/up rows,
residuals as GEMM operands) equals the model's own `generator_post`, and the re-laid-out model computes what it
did. GPU (skipped without CUDA / quack-kernels): quack's GEMMs against an fp32 oracle at the real call-site shapes,
and an engine on them replaying its CUDA graph bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle.quant_models import policy_inputs, tiny_model

from wamrt.engine import Engine, EngineConfig
from wamrt.engine.epilogues import (
    EpilogueMLP,
    InterleavedGateUp,
    act_reference,
    generator_post_reference,
    interleave_rows,
    prepare_epilogues,
    quack_available,
    unsupported_reason,
)
from wamrt.engine.fuse import fuse_generator

# fp32, the same products summed by the same kernels: only the residual's place in the sum differs (~1e-7 seen).
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _layer_inputs(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, cfg.hidden_size, generator=g)
    o = torch.randn(2, cfg.num_attention_heads, 7, cfg.head_dim, generator=g)
    return hidden, o


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-edge"])
def test_reference_tail_equals_generator_post(name) -> None:
    model = tiny_model(name, seed=5)
    original = copy.deepcopy(model)
    prepare_epilogues(model)
    g, o = _layer_inputs(model)
    for ours, theirs in zip(model.layers, original.layers, strict=True):
        want = theirs.generator_post(g, o)
        torch.testing.assert_close(generator_post_reference(ours, g, o), want, **FP32_TOL)
        torch.testing.assert_close(ours.generator_post(g, o), want, **FP32_TOL)  # the module's own math still
    mlp = model.layers[0].mlp_moe_gen
    assert isinstance(mlp, InterleavedGateUp if model.config.gated_mlp else EpilogueMLP)


def test_interleaving_a_fused_model_keeps_its_output_and_is_idempotent() -> None:
    model = tiny_model("tiny-qwen", seed=6)
    fuse_generator(model)  # [gate; up] rows first, as an earlier engine leaves the shared model
    ids, pos, tok = policy_inputs(model, 1)
    before = model(ids, pos, tok).action
    gate_up = model.layers[0].mlp_moe_gen.gate_up_proj.weight.detach().clone()
    prepare_epilogues(model)
    weight = model.layers[0].mlp_moe_gen.epilogue_weight
    gate, up = gate_up.chunk(2)
    assert torch.equal(weight[0::2], gate) and torch.equal(weight[1::2], up)
    prepare_epilogues(model)
    assert model.layers[0].mlp_moe_gen.epilogue_weight is weight  # nothing re-laid out twice
    torch.testing.assert_close(model(ids, pos, tok).action, before, **FP32_TOL)


def test_interleave_rows_and_activations() -> None:
    gate, up = torch.arange(6.0).view(3, 2), -torch.arange(6.0).view(3, 2)
    assert interleave_rows(gate, up)[:, 0].tolist() == [0, 0, 2, -2, 4, -4]
    y = torch.tensor([[-1.0, 2.0, 3.0, -4.0]])
    torch.testing.assert_close(act_reference(y, "relu_sq"), torch.tensor([[0.0, 4.0, 9.0, 0.0]]))
    torch.testing.assert_close(act_reference(y, "swiglu"), torch.nn.functional.silu(y[:, [0, 2]]) * y[:, [1, 3]])
    with pytest.raises(ValueError, match="activation"):
        act_reference(y, "gelu")


def test_engine_refuses_quack_where_it_cannot_run() -> None:
    from wamrt.pipeline.policy import random_policy

    policy = random_policy("tiny-qwen", torch.device("cpu"), torch.float32, tiny_vae=True)
    with pytest.raises(ValueError, match="epilogues='quack' needs quack-kernels"):
        Engine.from_policy(policy, EngineConfig(compile=False, cuda_graph=False, epilogues="quack"))
    with pytest.raises(ValueError, match="epilogues must be one of"):
        Engine.from_policy(policy, EngineConfig(compile=False, cuda_graph=False, epilogues="cutlass"))
    assert "float32" in unsupported_reason(policy.model)  # fp32 weights: the epilogue GEMMs take bf16


# -- GPU -----------------------------------------------------------------------------------------------------

M = 6186  # Generator tokens of both CFG branches at tier 480


@pytest.mark.gpu
@pytest.mark.skipif(not quack_available(), reason="needs CUDA and quack-kernels")
@pytest.mark.parametrize("hidden,inter,activation", [(2048, 9216, "relu_sq"), (4096, 12288, "swiglu")],
                         ids=["edge", "nano"])
def test_quack_call_sites_match_fp32(hidden, inter, activation) -> None:
    from wamrt.engine.epilogues import quack_gemm_act, quack_gemm_residual

    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, hidden, device=dev, generator=g, dtype=torch.bfloat16)
    res = torch.randn(M, hidden, device=dev, generator=g, dtype=torch.bfloat16)
    n_up = 2 * inter if activation == "swiglu" else inter
    w_up = (torch.randn(n_up, hidden, device=dev, generator=g) / hidden**0.5).bfloat16()
    w_down = (torch.randn(hidden, inter, device=dev, generator=g) / inter**0.5).bfloat16()
    act = quack_gemm_act(x, w_up, activation, [])
    act_ref = act_reference(x.float() @ w_up.float().t(), activation)
    unfused = act_reference((x @ w_up.t()).float(), activation)  # cuBLAS, rounded before the activation
    assert (act.float() - act_ref).abs().max() <= (unfused - act_ref).abs().max() * 1.01 + 1e-3
    out = quack_gemm_residual(act, w_down, res, [])
    out_ref = res.float() + act.float() @ w_down.float().t()
    unfused_out = (res + act @ w_down.t()).float()
    assert (out.float() - out_ref).abs().max() <= (unfused_out - out_ref).abs().max() * 1.01 + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not quack_available(), reason="needs CUDA and quack-kernels")
def test_engine_on_quack_replays_its_graph_exactly() -> None:
    from wamrt.pipeline.policy import random_policy
    from wamrt.sample import sample_observation

    dev = torch.device("cuda")
    policy = random_policy("nano", dev, torch.bfloat16, layers=2)
    eager = Engine.from_policy(policy, EngineConfig(cuda_graph=False, epilogues="quack"))
    graphed = Engine.from_policy(policy, EngineConfig(epilogues="quack"))
    inductor = Engine.from_policy(policy, EngineConfig())
    obs = sample_observation(3)
    a = eager.infer(obs, seed=7).actions
    for _ in range(3):  # warm-up, capture, replay
        b = graphed.infer(obs, seed=7).actions
    assert (a == b).all()
    c = inductor.infer(obs, seed=7).actions
    assert abs(a - c).max() < 0.05 * max(abs(c).max(), 1.0)  # same model, activation rounded once fewer


def test_site_tiles_pin_per_architecture() -> None:
    from wamrt.engine.epilogues import QUACK_DEFAULT, SM90_SITES, site_tiles

    assert site_tiles("swiglu", 5120, 51200, 9) == [int(t) for t in QUACK_DEFAULT]  # unlisted: the kind's default
    stay = [key for key, tiles in SM90_SITES.items() if tiles is None]
    assert stay and site_tiles(*stay[0], 9) is None  # measured slower than cuBLAS: the unfused path
    assert site_tiles(*stay[0], 10) == []  # Blackwell: quack's own default, nothing pinned


def test_quantized_or_fp32_weights_are_refused_with_the_reason() -> None:
    from wamrt.quant import quantize_model

    model = tiny_model("tiny-qwen", seed=8, dtype=torch.bfloat16)
    assert unsupported_reason(model) is None
    quantize_model(model, "gen-fp8")
    assert "Fp8Linear" in unsupported_reason(model)
    assert "float32" in unsupported_reason(tiny_model("tiny-edge", seed=8))
