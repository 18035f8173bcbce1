"""The decode step's attention (ops/decode_attention.py): the reference's semantics on the CPU (the cache written at
each row's position, keys after it not attended, the query heads of a K/V head sharing its keys), and the Triton
split-key kernel against the reference on the GPU, alone and inside a captured decode graph."""

from __future__ import annotations

import math

import pytest
import torch

from wamrt.ops.decode_attention import (
    BLOCK_N,
    decode_attention,
    decode_attention_problem,
    decode_attention_reference,
)

KERNEL_ATOL = 2e-2  # bf16 output of values ~N(0, 1): the kernel rounds P to bf16 before PV, as flash kernels do
KERNEL_RTOL = 2e-2


def _inputs(b: int, rows_max: int, kv_heads: int, group: int, d: int, length: int, index: list[int],
            device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(b, kv_heads * group, 1, d)
    k_new, v_new = randn(b, kv_heads, 1, d), randn(b, kv_heads, 1, d)
    keys, values = randn(rows_max, kv_heads, length, d), randn(rows_max, kv_heads, length, d)
    return q, k_new, v_new, keys, values, torch.tensor(index, device=device)


def test_reference_writes_the_cache_and_attends_up_to_each_rows_token() -> None:
    b, kvh, group, d, length, span = 2, 2, 3, 16, 64, 32
    index = [5, 17]
    q, k_new, v_new, keys, values, idx = _inputs(b, 3, kvh, group, d, length, index, "cpu", torch.float32)
    before = keys.clone()
    out = decode_attention_reference(q, k_new, v_new, keys, values, idx, span)
    assert out.shape == (b, kvh * group, 1, d)
    for r in range(b):
        assert torch.equal(keys[r, :, index[r]], k_new[r, :, 0]) and torch.equal(values[r, :, index[r]], v_new[r, :, 0])
        others = [p for p in range(length) if p != index[r]]
        assert torch.equal(keys[r, :, others], before[r, :, others])  # nothing else written
        for h in range(kvh * group):
            kh = h // group  # query heads 0..group-1 read K/V head 0, and so on
            scores = keys[r, kh, :index[r] + 1] @ q[r, h, 0] / math.sqrt(d)
            want = torch.softmax(scores, 0) @ values[r, kh, :index[r] + 1]
            assert torch.allclose(out[r, h, 0], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(keys[2], before[2])  # a row past the batch: untouched


def test_the_kernel_says_why_it_cannot_run_and_falls_back() -> None:
    q, k_new, v_new, keys, values, idx = _inputs(1, 1, 2, 4, 32, 128, [40], "cpu", torch.float32)
    assert "CUDA" in decode_attention_problem(q, keys)
    ref_keys, ref_values = keys.clone(), values.clone()
    ref = decode_attention_reference(q, k_new, v_new, ref_keys, ref_values, idx, 128)
    assert torch.equal(decode_attention(q, k_new, v_new, keys, values, idx, 128), ref)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("b", "kv_heads", "group", "d", "span", "index"), [
    (1, 8, 4, 128, 640, [600]),  # Nano's heads, a 600-token chat
    (1, 8, 4, 128, 128, [0]),  # the first position: one key
    (3, 8, 4, 128, 1024, [BLOCK_N - 1, BLOCK_N, 1000]),  # at a split's last and first key
    (2, 4, 8, 64, 256, [130, 7]),  # other head sizes and groups
    (2, 2, 1, 128, 8192, [8000, 4095]),  # long spans: 128 splits (8 merge passes)
    (1, 4, 3, 64, 2048, [1500]),  # a group that is no power of two; 32 splits (2 merge passes)
])
@pytest.mark.parametrize("merge", ["kernel", "last-split"])
def test_kernel_equals_the_reference_and_writes_the_same_cache(b, kv_heads, group, d, span, index, merge) -> None:
    """Both merges (a second kernel; the last split program to arrive, counted in `arrivals`) equal the reference,
    twice in a row: the counters the last programs set back to zero serve the next call."""
    length = span + 8
    arrivals = torch.zeros(b + 1, kv_heads, dtype=torch.int32, device="cuda") if merge == "last-split" else None
    for call in range(2):
        seed = len(index) + span + call
        q, k_new, v_new, keys, values, idx = _inputs(b, b + 1, kv_heads, group, d, length, index, "cuda",
                                                     torch.bfloat16, seed=seed)
        assert decode_attention_problem(q, keys) is None
        ref_keys, ref_values = keys.clone(), values.clone()
        ref = decode_attention_reference(q, k_new, v_new, ref_keys, ref_values, idx, span)
        out = decode_attention(q, k_new, v_new, keys, values, idx, span, arrivals=arrivals)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)  # the same cache, bit for bit
        assert torch.allclose(out.float(), ref.float(), atol=KERNEL_ATOL, rtol=KERNEL_RTOL), \
            (call, (out.float() - ref.float()).abs().max())
        if arrivals is not None:
            assert not arrivals.any(), arrivals


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_decode_with_the_kernel_equals_its_eager_steps(tmp_path) -> None:
    """The tiny Reasoner in bf16: decode steps with the split kernel replayed as CUDA graphs give the tokens the same
    kernel gives eagerly, and its logits at the first steps stay near the SDPA path's."""
    from oracle.reasoner import build_tiny_reasoner

    from wamrt.reasoner.engine import DecodeBatch
    from wamrt.reasoner.sampling import SamplingParams

    tiny = build_tiny_reasoner(tmp_path, vision=False)
    r = tiny.reasoner
    r.lm.to("cuda", torch.bfloat16)
    if decode_attention_problem(torch.empty(1, 1, 1, r.lm.config.head_dim, device="cuda", dtype=torch.bfloat16),
                                torch.empty(1, 1, 1, r.lm.config.head_dim, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("the tiny config's head size is not one the kernel takes")
    prompts = [r.prepare([{"role": "user", "content": t}]) for t in ("Hi there.", "A longer prompt about robots.")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        batch = DecodeBatch(r, 2, cuda_graphs=graphs, decode_attention="split")
        seqs = [batch.admit(p, params, tag=i).seq for i, p in enumerate(prompts)]
        while batch.live:
            batch.step()
        runs[graphs] = [s.tokens for s in seqs]
    assert runs[True] == runs[False]
    logits = {}
    for kind in ("sdpa", "split"):
        batch = DecodeBatch(r, 1, cuda_graphs=False, decode_attention=kind)
        batch.admit(prompts[1], params)
        seq = batch.live[0]
        t = torch.tensor([seq.tokens[-1]], device="cuda")
        i = torch.tensor([seq.index], device="cuda")
        p = torch.tensor([float(seq.prompt.next_position)], device="cuda")
        logits[kind] = r.lm.decode_step(batch.cache, t, i, p, 128, attention=kind).float()
    assert torch.allclose(logits["split"], logits["sdpa"], atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "index"), [(32, 8, 128, [600]), (8, 2, 64, [5, 190])])
@pytest.mark.parametrize("launch", ["plain", "pdl", "last-split+pdl"])
def test_kernel_from_raw_projections_applies_the_norms_and_rope(qk_norm, heads, kv_heads, d, index, launch) -> None:
    """`decode_attention_from_projections`: the q/k norms and RoPE inside the split kernel equal the model's
    `reasoner_heads` followed by the reference, output and cache (the new key normed and rotated); also launched with
    PDL right after the kernel that computes its projections, its splits merged by a PDL merge kernel or by the last
    split program."""
    from wamrt.ops.triton_support import pdl_problem

    if launch != "plain" and pdl_problem(torch.device("cuda")):
        pytest.skip(pdl_problem(torch.device("cuda")))
    import dataclasses

    from wamrt.model.config import get_config
    from wamrt.model.layer import MoTAttention
    from wamrt.model.rope import mrope_tables
    from wamrt.ops.decode_attention import (
        decode_attention_from_projections,
        decode_attention_from_projections_problem,
    )

    b, third = len(index), d // 2 // 3
    axes = (d // 2 - 2 * third, third, third)
    cfg = dataclasses.replace(get_config("tiny-qwen"), hidden_size=heads * d, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, head_dim=d, rope_axes_dim=axes, qk_norm_for_text=qk_norm)
    attn = MoTAttention(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    gen = torch.Generator(device="cuda").manual_seed(d)
    if qk_norm:
        for norm in (attn.norm_q, attn.norm_k):
            norm.weight.copy_(1 + 0.3 * torch.randn(d, device="cuda", generator=gen))
    qkv = (2 * torch.randn(b, 1, (heads + 2 * kv_heads) * d, device="cuda", generator=gen)).to(torch.bfloat16)
    idx = torch.tensor(index, device="cuda")
    rope = mrope_tables(idx.float()[:, None, None].expand(b, 3, 1), head_dim=d, theta=5e6, axes=axes,
                        dtype=torch.bfloat16)
    keys = torch.randn(b, kv_heads, 1024, d, device="cuda", generator=gen).to(torch.bfloat16)
    values = torch.randn(b, kv_heads, 1024, d, device="cuda", generator=gen).to(torch.bfloat16)
    span = -(-(max(index) + 1) // BLOCK_N) * BLOCK_N
    k_ref, v_ref = keys.clone(), values.clone()
    q, k, _, v = attn.reasoner_heads(*qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1), rope)
    ref = decode_attention_reference(q, k, v, k_ref, v_ref, idx, span)
    norms = (attn.norm_q, attn.norm_k) if qk_norm else (None, None)
    assert decode_attention_from_projections_problem(qkv, keys, values, *norms, rope.cos) is None
    arrivals = torch.zeros(b, kv_heads, dtype=torch.int32, device="cuda") if launch.startswith("last-split") else None
    raw = qkv.clone()
    qkv.zero_()
    qkv.add_(raw)  # the projections come from the kernel just before, which a PDL launch must wait for
    out = decode_attention_from_projections(qkv, heads, kv_heads, *norms, rope.cos, rope.sin, keys, values, idx, span,
                                            arrivals=arrivals, pdl=launch != "plain")
    assert out.shape == ref.shape
    assert torch.allclose(out.float(), ref.float(), atol=KERNEL_ATOL, rtol=KERNEL_RTOL), (out - ref).abs().max()
    assert torch.allclose(keys.float(), k_ref.float(), atol=KERNEL_ATOL, rtol=KERNEL_RTOL)  # the key it wrote
    assert torch.equal(values, v_ref)
