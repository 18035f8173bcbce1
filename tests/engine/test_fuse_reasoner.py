"""`fuse_reasoner`: the Reasoner's q/k/v and gate/up served from one matrix each, for its text decode. The
oracle is the same model unfused, in the test (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from wamrt.engine.fuse import fuse_generator, fuse_reasoner
from wamrt.pipeline.random_weights import random_transformer
from wamrt.reasoner.lm import KVCache, ReasonerLM
from wamrt.reasoner.load import random_lm_head

LOGIT_ATOL = 1e-5  # fp32: one GEMM over the concatenated rows against three; only summation order can differ


def _lm(seed: int = 0) -> ReasonerLM:
    model = random_transformer("tiny-qwen", torch.device("cpu"), torch.float32, seed=seed)
    return ReasonerLM(model, random_lm_head(model, seed=1))


def _prompt_and_steps(lm: ReasonerLM, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Logits of the prompt's last token, then of `steps` greedy decode steps through the K/V cache."""
    cache = KVCache.empty(lm.transformer, 1, 64)
    positions = torch.arange(len(ids), dtype=torch.float32).expand(3, -1)[None]
    out = [lm.run_prompt(lm.embed(torch.tensor([ids])), positions, cache=cache)]
    for i in range(steps):
        index = torch.tensor([len(ids) + i])
        token = out[-1].argmax(-1)
        out.append(lm.decode_step(cache, token, index, index.float(), span=64))
    return out


@torch.no_grad()
def test_fused_reasoner_decodes_what_the_unfused_one_does():
    ids = list(range(3, 40, 3))
    reference = _prompt_and_steps(_lm(), ids, 6)
    lm = _lm()
    fuse_reasoner(lm.transformer)
    attn, mlp = lm.transformer.layers[0].self_attn, lm.transformer.layers[0].mlp
    assert attn.to_q is None and attn.qkv_proj.weight.shape[0] == sum(attn.reasoner_qkv_sizes)  # one copy
    assert mlp.gate_proj is None and mlp.gate_up_proj is not None
    fused = _prompt_and_steps(lm, ids, 6)
    for ref, got in zip(reference, fused, strict=True):
        torch.testing.assert_close(got, ref, atol=LOGIT_ATOL, rtol=0)
    assert [r.argmax(-1).item() for r in reference] == [f.argmax(-1).item() for f in fused]


@pytest.mark.parametrize("generator_first", [True, False])
@torch.no_grad()
def test_fuse_reasoner_is_idempotent_and_composes_with_the_generator_fusion(generator_first):
    """Either fusion on top of the other (the policy engine fuses the Generator), and a second call changes nothing:
    both streams keep their math."""
    ids = [5, 9, 2, 7]
    reference = _prompt_and_steps(_lm(), ids, 3)
    lm = _lm()
    for fuse in (fuse_generator, fuse_reasoner) if generator_first else (fuse_reasoner, fuse_generator):
        fuse(lm.transformer)
    attn = lm.transformer.layers[0].self_attn
    cls, qkv = type(attn), attn.qkv_proj
    fuse_reasoner(lm.transformer)
    fuse_generator(lm.transformer)
    assert type(attn) is cls and attn.qkv_proj is qkv
    assert attn.add_qkv_proj is not None  # the Generator's fusion is still served
    x = torch.randn(1, 3, lm.transformer.layers[0].input_layernorm.weight.shape[0])
    q, k, v = attn.generator_projections(x)
    assert q.shape[-1] == attn.num_heads * attn.head_dim and k.shape == v.shape
    for ref, got in zip(reference, _prompt_and_steps(lm, ids, 3), strict=True):
        torch.testing.assert_close(got, ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("mode", [None, "coordinate-descent"])
def test_compiled_decode_layers_run_on_the_fused_matrices(tmp_path, mode):
    """reasoner/fused.py's compiled regions over a fused model (what `wamrt bench decode` times last), in its compile
    modes: the same greedy tokens as the eager layers over the same fused model."""
    from oracle.reasoner import build_tiny_reasoner
    from torch._dynamo.utils import counters

    from wamrt.reasoner.engine import DecodeBatch
    from wamrt.reasoner.sampling import SamplingParams

    torch._dynamo.reset()  # an earlier test may have compiled the same regions (the cache is per function): count anew
    graphs_before = counters["stats"]["unique_graphs"]
    r = build_tiny_reasoner(tmp_path, vision=False).reasoner
    fuse_reasoner(r.lm.transformer)
    prompts = [r.prepare([{"role": "user", "content": c}]) for c in ("Short.", "A longer prompt about robots.")]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = {}
    for fused in (False, True):
        batch = DecodeBatch(r, 2, cuda_graphs=False, fused=fused, fused_mode=mode)
        seqs = [batch.admit(p, params).seq for p in prompts]
        while batch.live:
            batch.step()
        tokens[fused] = [s.tokens for s in seqs]
    assert counters["stats"]["unique_graphs"] - graphs_before >= 2  # both regions compiled (not the fallback)
    assert tokens[True] == tokens[False] and len(tokens[True][1]) == 10


def test_fused_decode_layer_names_an_unknown_mode():
    from wamrt.reasoner.fused import FUSED_MODES, FusedDecodeLayer

    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        FusedDecodeLayer("fastest")
    assert "default" in FUSED_MODES
