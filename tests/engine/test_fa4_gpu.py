"""FlashAttention-4 as the Generator attention backend ("fa4"): against SDPA at Nano shapes, its log-sum-exp in
the convention the prompt buckets need, and inside a CUDA graph. Skipped without CUDA or flash-attn-4; the CPU
part checks that asking for it where it cannot run is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wamrt.ops.attention import fa4_available

# bf16 attention outputs of two kernels (each rounds once, in a different order): relative L2 well below 1e-2.
OUT_REL_L2 = 1e-2
LSE_MAX_ABS = 1e-2  # fp32 log-sum-exp of bf16 inputs, two summation orders

needs_fa4 = pytest.mark.skipif(not fa4_available(), reason="needs flash-attn-4 on a Hopper/Blackwell GPU")


def test_fa4_where_it_cannot_run_is_a_clear_error():
    from wamrt.engine import Engine, EngineConfig
    from wamrt.pipeline.policy import random_policy

    if fa4_available():
        pytest.skip("flash-attn-4 is available here")
    policy = random_policy("tiny-qwen", "cpu", torch.float32, tiny_vae=True)
    with pytest.raises(ValueError, match="flash-attn-4"):
        Engine.from_policy(policy, EngineConfig(attention="fa4", compile=False, cuda_graph=False))


def _qkv(sq: int, sk: int, heads: int = 32, d: int = 128, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (sq, sk, sk)]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("sq,sk", [(3092, 3220), (3510, 3638), (1024, 1152)])  # policy, i2v, t2i (Nano heads)
def test_fa4_matches_sdpa_and_its_lse(sq: int, sk: int):
    from wamrt.ops.attention import fa4_attention, sdpa_with_lse

    q, k, v = _qkv(sq, sk)
    want, want_lse = sdpa_with_lse(q, k, v, backend="cudnn")
    got, lse = fa4_attention(q, k, v, return_lse=True)
    assert got.shape == want.shape and lse.shape == want_lse.shape
    assert _rel_l2(got, want) <= OUT_REL_L2
    assert (lse - want_lse).abs().max().item() <= LSE_MAX_ABS
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    print(f"\nfa4 vs fp32 {_rel_l2(got, exact):.2e}, cuDNN vs fp32 {_rel_l2(want, exact):.2e}")


@pytest.mark.gpu
@needs_fa4
def test_fa4_prompt_buckets_and_graph_replay():
    from wamrt.ops.attention import ZeroKeyAttention, zero_key_attention_problem

    assert zero_key_attention_problem(torch.device("cuda"), torch.bfloat16, "fa4") is None
    q, k, v = _qkv(3510, 3638)
    valid = torch.ones(2, 3638, dtype=torch.bool, device="cuda")
    valid[1, :40] = False
    k[1, :, :40] = 0
    v[1, :, :40] = 0
    attn = ZeroKeyAttention(valid, backend="fa4")
    eager = attn(q, k, v, causal=False)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    assert _rel_l2(eager, masked) <= OUT_REL_L2

    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn(*static, causal=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(*static, causal=False)
    q2, k2, v2 = _qkv(3510, 3638, seed=1)
    for dst, src in zip(static, (q2, k2, v2), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attn(q2, k2, v2, causal=False)), "replay == eager on new inputs"


@pytest.mark.gpu
@needs_fa4
def test_fa4_key_lengths_one_call_matches_per_sequence_sdpa_and_replays():
    """KeyLengthAttention on fa4 (one call, seqused_k) against one SDPA call per sequence on its own keys, at the
    Nano policy shape ([Generator | prefix | zeros]: 3092 + 125 keys and 3092 + 30 + 95 zeros), eager and replayed
    from a CUDA graph with new inputs; the lengths tensor is made inside the capture."""
    from wamrt.ops.attention import KeyLengthAttention

    lengths = [3092 + 125, 3092 + 30]
    q, k, v = _qkv(3092, 3092 + 125)
    for t in (k, v):
        t[1, :, lengths[1]:] = 0
    attn = KeyLengthAttention(lengths, torch.device("cuda"), backend="fa4")
    got = attn(q, k, v, causal=False)
    for b, n in enumerate(lengths):
        want = F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        assert _rel_l2(got[b : b + 1], want) <= OUT_REL_L2, b

    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        KeyLengthAttention(lengths, torch.device("cuda"))(*static, causal=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KeyLengthAttention(lengths, torch.device("cuda"))(*static, causal=False)
    q2, k2, v2 = _qkv(3092, 3092 + 125, seed=1)
    for t in (k2, v2):
        t[1, :, lengths[1]:] = 0
    for dst, src in zip(static, (q2, k2, v2), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attn(q2, k2, v2, causal=False)), "replay == eager on new inputs"
