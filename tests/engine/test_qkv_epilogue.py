"""The Generator's q/k/v epilogue in one kernel (`engine/qkv_epilogue.py`): the engine's wiring on the CPU (reference
paths, config errors) and, on CUDA, the Triton kernel against the model's eager `generator_heads` plus the buffer
stores at Edge and Nano shapes, in a CUDA graph, and timed against Inductor's kernels for the same work."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from random_layers import one_layer_model

from wamrt.engine.layer_halves import generator_projections, generator_qkv, pre_heads, pre_into
from wamrt.engine.qkv_epilogue import generator_heads_into, generator_heads_into_reference, head_epilogue_problem
from wamrt.model import Rope

# The kernel computes in fp32 and rounds once per element (as Inductor does); eager bf16 rounds after every op. Against
# the same function in fp32, the kernel may be no less accurate than eager (it is measured more accurate).
NOT_WORSE_THAN_EAGER = 1.0


def _layer(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    model, cfg = one_layer_model(name, device, dtype)
    return model.layers[0], cfg


def _rope(bsz: int, g_len: int, d: int, device: str, dtype: torch.dtype, seed: int = 3) -> Rope:
    gen = torch.Generator(device=device).manual_seed(seed)
    ang = 40 * torch.rand(bsz, g_len, d // 2, device=device, generator=gen)
    emb = torch.cat([ang, ang], dim=-1)
    return Rope(emb.cos().to(dtype), emb.sin().to(dtype))


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-edge"])
@pytest.mark.parametrize("grouped", [False, True])
@torch.no_grad()
def test_projections_then_reference_heads_equal_the_layers_pre_on_cpu(name, grouped, monkeypatch):
    """`pre_heads(generator_projections)` with the reference epilogue is the inductor path (`pre_into`) bit for bit:
    the split of the layer's pre half the engine compiles around the kernel computes the same function."""
    layer, cfg = _layer(name)
    bsz, g_len, start = 2, 24, 5
    heads = cfg.num_key_value_heads if grouped else cfg.num_attention_heads
    torch.manual_seed(1)
    g, update = torch.randn(2, bsz, g_len, cfg.hidden_size).unbind(0)
    rope = _rope(bsz, g_len, cfg.head_dim, "cpu", torch.float32)
    bufs = [torch.randn(bsz, heads, start + g_len + 3, cfg.head_dim) for _ in range(2)]
    want_bufs = [b.clone() for b in bufs]
    q_want, g_want = pre_into(generator_qkv)(layer, g, update, rope, *want_bufs, start)

    import wamrt.engine.layer_halves as halves

    monkeypatch.setattr(halves, "generator_heads_into", generator_heads_into_reference)
    q, g2 = pre_heads(generator_projections)(layer, g, update, rope, *bufs, start)
    assert torch.equal(q, q_want) and torch.equal(g2, g_want)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want_bufs, strict=True))
    assert not torch.equal(bufs[0][:, :, start:start + g_len], torch.zeros_like(bufs[0][:, :, start:start + g_len]))


def test_problem_names_what_the_kernel_cannot_serve():
    layer, _ = _layer("tiny-qwen")
    attn = layer.self_attn
    assert "CUDA" in head_epilogue_problem(attn, torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        assert "float32" in head_epilogue_problem(attn, torch.device("cuda"), torch.float32)


def test_engine_head_epilogue_config(tmp_path, monkeypatch):
    from wamrt import load_policy
    from wamrt.engine import Engine, EngineConfig

    monkeypatch.setenv("WAMRT_CACHE", str(tmp_path))
    pol = load_policy("tiny-droid", device="cpu")
    base = dict(attention="auto", compile=False, cuda_graph=False)
    assert Engine.from_policy(pol, EngineConfig(head_epilogue="auto", **base)).head_epilogue == "inductor"
    meta = Engine.from_policy(pol, EngineConfig(**base)).metadata()["engine"]
    assert meta["head_epilogue"] == "inductor" and meta["gqa_buffers"] is False  # the defaults off CUDA / fa4
    assert Engine.from_policy(pol, EngineConfig(gqa_buffers=True, **base)).metadata()["engine"]["gqa_buffers"]
    with pytest.raises(ValueError, match="head_epilogue='triton' cannot serve this model here: .*CUDA"):
        Engine.from_policy(pol, EngineConfig(head_epilogue="triton", **base))
    with pytest.raises(ValueError, match="head_epilogue must be one of"):
        Engine.from_policy(pol, EngineConfig(head_epilogue="cuda", **base))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# Edge (Nemotron norms, 16 / 8 heads) and Nano (32 / 8), CFG batch of 2 at tier 480; buffers at the query heads
# (repeated K/V) and at the K/V heads, in the two layouts' offsets (prefix first: start = 160; Generator first: 0).
@pytest.mark.parametrize("name", ["edge", "nano"])
@pytest.mark.parametrize("grouped,start", [(False, 160), (True, 0)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_triton_heads_match_the_fp32_function_and_replay(name, grouped, start):
    layer, cfg = _layer(name, "cuda", torch.bfloat16)
    attn = layer.self_attn
    assert head_epilogue_problem(attn, torch.device("cuda"), torch.bfloat16) is None
    bsz, g_len, d = 2, 3092, cfg.head_dim
    heads = cfg.num_key_value_heads if grouped else cfg.num_attention_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(bsz, g_len, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, device="cuda",
                       dtype=torch.bfloat16, generator=gen) * 3
    q, k, v = proj.split([cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d], -1)
    rope = _rope(bsz, g_len, d, "cuda", torch.bfloat16)
    length = 160 + g_len + 64
    arena = torch.randn(2, bsz * heads * length * d, device="cuda", dtype=torch.bfloat16, generator=gen)
    before = [arena[i].view(bsz, heads, length, d).clone() for i in (0, 1)]
    want_bufs = [b.clone() for b in before]
    bufs = [arena[i].view(bsz, heads, length, d) for i in (0, 1)]  # arena views, as the engine's graphs use
    q_want = generator_heads_into_reference(attn, q, k, v, rope, *want_bufs, start)  # eager bf16
    truth_bufs = [b.float() for b in before]
    attn32 = copy.deepcopy(attn).float()
    q_truth = generator_heads_into_reference(attn32, q.float(), k.float(), v.float(), Rope(*(t.float() for t in rope)),
                                             *truth_bufs, start)
    q_got = generator_heads_into(attn, q, k, v, rope, *bufs, start)
    assert q_got.shape == q_want.shape and q_got.stride() == q_want.stride()
    inside = slice(start, start + g_len)
    keys = (bufs[0][:, :, inside], want_bufs[0][:, :, inside], truth_bufs[0][:, :, inside])
    for what, got, want, truth in (("q", q_got, q_want, q_truth), ("k", *keys)):
        ours, eager = _rel_l2(got, truth), _rel_l2(want, truth)
        print(f"\n{name} grouped={grouped} {what}: rel L2 vs fp32 {ours:.3e} (eager bf16 {eager:.3e}), "
              f"vs eager {_rel_l2(got, want):.3e}")
        assert ours <= NOT_WORSE_THAN_EAGER * eager, what
    assert torch.equal(bufs[1], want_bufs[1])  # v is a copy
    for i in (0, 1):  # nothing written outside the Generator's positions
        assert torch.equal(bufs[i][:, :, :start], before[i][:, :, :start])
        assert torch.equal(bufs[i][:, :, start + g_len:], before[i][:, :, start + g_len:])

    # in a CUDA graph, on new inputs: the same bits as a direct launch
    static = proj.clone()
    sq, sk, sv = static.split([q.shape[-1], k.shape[-1], v.shape[-1]], -1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        generator_heads_into(attn, sq, sk, sv, rope, *bufs, start)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph = generator_heads_into(attn, sq, sk, sv, rope, *bufs, start)
    static.copy_(torch.randn(static.shape, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    replay = [q_graph.clone(), bufs[0].clone(), bufs[1].clone()]
    again = generator_heads_into(attn, sq, sk, sv, rope, *bufs, start)
    assert torch.equal(replay[0], again) and torch.equal(replay[1], bufs[0]) and torch.equal(replay[2], bufs[1])

    # timed against Inductor's kernels for the same work (reported; the engine rows are the claim)
    compiled = torch.compile(generator_heads_into_reference, dynamic=False)
    timings = {}
    for label, fn in (("inductor", compiled), ("triton", generator_heads_into)):
        for _ in range(3):
            fn(attn, q, k, v, rope, *bufs, start)
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        for _ in range(50):
            fn(attn, q, k, v, rope, *bufs, start)
        end_evt.record()
        torch.cuda.synchronize()
        timings[label] = 1e3 * start_evt.elapsed_time(end_evt) / 50
    moved = (proj.numel() + q.numel() + 2 * bsz * heads * g_len * d) * 2
    q_inductor = compiled(attn, q, k, v, rope, *[b.clone() for b in before], start)
    print(f"{name} grouped={grouped}: inductor {timings['inductor']:.1f} us, triton {timings['triton']:.1f} us "
          f"({moved / timings['triton'] / 1e6:.2f} TB/s); q vs Inductor's: rel L2 {_rel_l2(q_got, q_inductor):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_triton_heads_replays_its_compiled_self():
    """An engine of two full-width Nano layers with the kernel: graph replay equal to the compiled engine without
    graphs, and within bf16 noise of the inductor epilogue."""
    from wamrt.engine import Engine, EngineConfig
    from wamrt.pipeline.policy import random_policy
    from wamrt.sample import sample_observation

    pol = random_policy("nano", "cuda", torch.bfloat16, layers=2)
    obs = sample_observation(0)
    graph = Engine.from_policy(pol, EngineConfig(head_epilogue="triton"))
    eager = Engine.from_policy(pol, EngineConfig(head_epilogue="triton", cuda_graph=False))
    inductor = Engine.from_policy(pol, EngineConfig(cuda_graph=False, head_epilogue="inductor"))
    assert graph.metadata()["engine"]["head_epilogue"] == "triton"
    a, b = graph.infer(obs, seed=5).actions, eager.infer(obs, seed=5).actions
    c = inductor.infer(obs, seed=5).actions
    assert np.array_equal(a, b)
    rel = float(np.linalg.norm(a - c) / np.linalg.norm(c))
    print(f"\ntriton vs inductor head epilogue, 2 Nano layers: rel L2 {rel:.2e}")
    assert 0 < rel < 2e-2  # different kernels (0 would mean the same path ran twice)


# gen-fp8: the q/k/v GEMM with the head epilogue inside (`fp8_qkv_heads_into`) against the same GEMM's output through
# the separate epilogue kernel. Only the GEMM's fp32 summation order differs (which flips a bf16 rounding here and
# there), so the outputs agree far closer than the e4m3 noise (~3e-2).
QKV_HEADS_REL_L2 = 5e-3


@pytest.mark.parametrize("name", ["edge", "nano"])
@pytest.mark.parametrize("grouped,start", [(False, 160), (True, 0)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
@torch.no_grad()
def test_fp8_qkv_gemm_with_heads_matches_gemm_then_heads_and_replays(name, grouped, start):
    from wamrt.engine.fuse import fuse_generator
    from wamrt.engine.qkv_epilogue import fp8_qkv_heads_into, fp8_qkv_heads_problem
    from wamrt.ops.fp8_gemm import fp8_gemm
    from wamrt.quant import quantize_model
    from wamrt.quant.fp8 import quantize_rowwise_fp8

    model, cfg = one_layer_model(name, "cuda", torch.bfloat16)
    fuse_generator(model)
    quantize_model(model, "gen-fp8")
    attn = model.layers[0].self_attn
    assert fp8_qkv_heads_problem(attn, torch.device("cuda"), torch.bfloat16) is None
    bsz, g_len, d = 2, 3092, cfg.head_dim
    heads = cfg.num_key_value_heads if grouped else cfg.num_attention_heads
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(bsz * g_len, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq, xs = quantize_rowwise_fp8(x)
    rope = _rope(bsz, g_len, d, "cuda", torch.bfloat16)
    length = 160 + g_len + 64
    before = [torch.randn(bsz, heads, length, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in (0, 1)]
    want_bufs = [b.clone() for b in before]
    proj = fp8_gemm(xq, xs, attn.add_qkv_proj.weight, attn.add_qkv_proj.weight_scale).view(bsz, g_len, -1)
    q, k, v = proj.split(attn.qkv_sizes, dim=-1)
    q_want = generator_heads_into(attn, q, k, v, rope, *want_bufs, start)
    bufs = [b.clone() for b in before]
    q_got = fp8_qkv_heads_into(attn, xq, xs, (bsz, g_len), rope, *bufs, start)
    assert q_got.shape == q_want.shape and q_got.stride() == q_want.stride()
    inside = slice(start, start + g_len)
    for what, got, want in (("q", q_got, q_want), ("k", bufs[0][:, :, inside], want_bufs[0][:, :, inside]),
                            ("v", bufs[1][:, :, inside], want_bufs[1][:, :, inside])):
        rel = _rel_l2(got, want)
        print(f"\n{name} grouped={grouped} {what}: rel L2 vs GEMM then heads {rel:.2e}")
        assert rel <= QKV_HEADS_REL_L2, what
    for i in (0, 1):  # nothing written outside the Generator's positions
        assert torch.equal(bufs[i][:, :, :start], before[i][:, :, :start])
        assert torch.equal(bufs[i][:, :, start + g_len:], before[i][:, :, start + g_len:])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph = fp8_qkv_heads_into(attn, xq, xs, (bsz, g_len), rope, *bufs, start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_graph, q_got)  # replay: the eager call's bits

    timings = {}
    for label, fn in (("gemm+heads", lambda: generator_heads_into(attn, *fp8_gemm(
            xq, xs, attn.add_qkv_proj.weight, attn.add_qkv_proj.weight_scale).view(bsz, g_len, -1).split(
            attn.qkv_sizes, dim=-1), rope, *bufs, start)),
                      ("cublas+heads", lambda: generator_heads_into(attn, *attn.add_qkv_proj.matmul_quantized(
                          xq, xs, torch.bfloat16).view(bsz, g_len, -1).split(attn.qkv_sizes, dim=-1), rope, *bufs,
                          start)),
                      ("fused", lambda: fp8_qkv_heads_into(attn, xq, xs, (bsz, g_len), rope, *bufs, start))):
        for _ in range(3):
            fn()
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        for _ in range(50):
            fn()
        end_evt.record()
        torch.cuda.synchronize()
        timings[label] = 1e3 * start_evt.elapsed_time(end_evt) / 50
    print(f"{name} grouped={grouped}: " + ", ".join(f"{k} {v:.1f} us" for k, v in timings.items()))
