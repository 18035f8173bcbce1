"""The Reasoner/Generator split the engine relies on: cached Reasoner K/V reproduce the full forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_parity_diffusers import make_request, our_inputs

from wamrt.model import Cosmos3Transformer, get_config, init_random_, stack_reasoner_kv


@pytest.fixture(params=["tiny-qwen", "tiny-edge"])
def model(request):
    return init_random_(Cosmos3Transformer(get_config(request.param)).eval().requires_grad_(False), seed=11)


def test_cached_reasoner_kv_equals_full_forward_bitwise(model):
    req = make_request(model.config, "policy", sound=False, seed=1)
    ids, pos, tok = our_inputs(model, req)
    rope_und, rope_gen = model.rope(pos).split(ids.shape[1])
    kv = model.prefill_reasoner(ids, rope_und)  # once ...
    assert len(kv.keys) == model.config.num_hidden_layers
    for t in (999.0, 624.0, 3.0):  # ... reused at every step
        step_tok = dataclasses.replace(tok, timesteps=torch.tensor([t]))
        full = model(ids, pos, step_tok)
        split = model.generator_step(step_tok, rope_gen, kv)
        assert torch.equal(full.vision, split.vision)
        assert torch.equal(full.action, split.action)


def test_reasoner_kv_depends_only_on_the_prompt(model):
    a = make_request(model.config, "policy", sound=False, seed=2)
    ids, pos, _ = our_inputs(model, a)
    rope_und, _ = model.rope(pos).split(ids.shape[1])
    kv1 = model.prefill_reasoner(ids, rope_und)
    ids2 = ids.clone()
    ids2[0, -1] = (ids2[0, -1] + 1) % model.config.vocab_size
    kv2 = model.prefill_reasoner(ids2, rope_und)
    # Causal: changing the last token leaves every earlier key untouched and moves the last one.
    assert torch.equal(kv1.keys[-1][..., :-1, :], kv2.keys[-1][..., :-1, :])
    assert not torch.equal(kv1.keys[-1][..., -1, :], kv2.keys[-1][..., -1, :])


def test_cfg_branches_batched_with_padded_prefixes(model):
    """cond (long prompt) and uncond (short prompt) in one Generator pass == two separate passes."""
    cfg = model.config
    cond = make_request(cfg, "policy", sound=False, seed=3, text=13)
    uncond = dataclasses.replace(cond, input_ids=cond.input_ids[:4])
    outs, kvs, ropes, toks = [], [], [], []
    for req in (cond, uncond):
        ids, pos, tok = our_inputs(model, req)
        rope_und, rope_gen = model.rope(pos).split(ids.shape[1])
        kv = model.prefill_reasoner(ids, rope_und)
        outs.append(model.generator_step(tok, rope_gen, kv))
        kvs.append(kv)
        ropes.append(rope_gen)
        toks.append(tok)
    batched_kv = stack_reasoner_kv(kvs)
    assert batched_kv.key_mask is not None and batched_kv.key_mask.sum().item() == 13 + 4
    rope = type(ropes[0])(torch.cat([r.cos for r in ropes]), torch.cat([r.sin for r in ropes]))
    tok = dataclasses.replace(
        toks[0],
        timesteps=torch.cat([t.timesteps for t in toks]),
        vision=torch.cat([t.vision for t in toks]),
        vision_noisy=torch.cat([t.vision_noisy for t in toks]),
        action=torch.cat([t.action for t in toks]),
        action_noisy=torch.cat([t.action_noisy for t in toks]),
        domain_ids=torch.cat([t.domain_ids for t in toks]),
    )
    both = model.generator_step(tok, rope, batched_kv)
    for i, single in enumerate(outs):
        for name in ("vision", "action"):
            ref = getattr(single, name)[0]
            err = (getattr(both, name)[i] - ref).abs().max().item()
            assert err <= 1e-5 * ref.abs().max().item(), (i, name, err)
    # The branches really differ (the prompt matters), so the check above is not vacuous.
    assert (outs[0].action - outs[1].action).abs().max() > 1e-3
