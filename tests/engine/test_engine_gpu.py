"""Engine correctness on the GPU at the full Nano shape (random bf16 weights). Skipped without CUDA.

Random weights at full depth amplify bf16 rounding: two bf16 runs that differ only in GEMM batching
(sequential vs batched CFG) already differ by ~3e-2 relative L2 in the final chunk. So besides the
direct comparison, each engine configuration is judged against an fp32 run of the same weights (the
function being computed): it must be no further from it than the bf16 eager reference is.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Issue 4's bar for engine vs eager bf16 reference; reported, not asserted: at random full-size weights
# even a pure GEMM-batching change moves the chunk by ~3e-2 (measured; see the module docstring).
REL_L2_VS_REFERENCE = 1e-2
NOT_WORSE_THAN_BF16 = 1.25  # engine-vs-fp32 error / reference-vs-fp32 error


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def nano():
    from wamrt.pipeline.policy import random_policy

    return random_policy("nano", "cuda", torch.bfloat16)


def test_engine_vs_reference_fp32_truth_and_graph_bitwise(nano):
    from wamrt.engine import Engine, EngineConfig
    from wamrt.ops.attention import fa4_available
    from wamrt.pipeline.policy import Policy
    from wamrt.pipeline.vae import FrameEncoder
    from wamrt.sample import sample_observation

    obs = sample_observation(0)
    ref = nano.infer(obs, seed=5)  # eager bf16 reference (pipeline.denoise), same noise
    model32 = copy.deepcopy(nano.model).float()
    vae32 = copy.deepcopy(nano.encoder.vae).float()
    truth = Policy(model32, FrameEncoder(vae32), nano.tokenizer, nano.contract, nano.options).infer(obs, seed=5)
    del model32, vae32
    torch.cuda.empty_cache()
    ref_err = rel_l2(ref.actions, truth.actions)

    runs = {}
    runs["sequential"] = Engine.from_policy(nano, EngineConfig(batch_cfg=False, compile=False, cuda_graph=False))
    runs["batched"] = Engine.from_policy(nano, EngineConfig(compile=False, cuda_graph=False))
    runs["batched-mask"] = Engine.from_policy(nano, EngineConfig(compile=False, cuda_graph=False,
                                                                 cfg_attention="mask"))
    runs["compiled"] = Engine.from_policy(nano, EngineConfig(cuda_graph=False))  # Triton head epilogue ("auto")
    runs["graph"] = Engine.from_policy(nano, EngineConfig())
    runs["compiled-inductor-heads"] = Engine.from_policy(nano, EngineConfig(cuda_graph=False,
                                                                            head_epilogue="inductor"))
    runs["graph-inductor-heads"] = Engine.from_policy(nano, EngineConfig(head_epilogue="inductor"))
    runs["graph-sync"] = Engine.from_policy(nano, EngineConfig(overlap_encode=False))  # the host waits for the VAE
    # the host pads the canvas and the VAE graph starts from [-1, 1] pixels (pageable upload)
    runs["graph-host-canvas"] = Engine.from_policy(nano, EngineConfig(canvas_on_device=False))
    assert runs["graph"].head_epilogue == "triton"
    if fa4_available():  # both CFG branches in one flash-attn-4 call (keys [Generator | prefix | zeros])
        runs["graph-fa4-lengths"] = Engine.from_policy(nano, EngineConfig(attention="fa4", cfg_attention="lengths",
                                                                          gqa_buffers=False))
        # ... with the buffers at the 8 K/V heads, the kernel sharing them across the 32 query heads (the fa4 default)
        runs["graph-fa4-gqa"] = Engine.from_policy(nano, EngineConfig(attention="fa4", cfg_attention="lengths"))
    out = {name: e.infer(obs, seed=5).actions for name, e in runs.items()}
    replay = runs["graph"].infer(obs, seed=5).actions
    for name in ("graph-fa4-lengths", "graph-fa4-gqa"):
        if name in runs:
            assert np.array_equal(runs[name].infer(obs, seed=5).actions, out[name]), name
    assert np.array_equal(out["graph-inductor-heads"], out["compiled-inductor-heads"])
    report = {name: (rel_l2(a, ref.actions), rel_l2(a, truth.actions)) for name, a in out.items()}
    print(f"\nbf16 reference vs fp32: {ref_err:.3e}")
    for name, (vs_ref, vs_truth) in report.items():
        print(f"{name:>13}: vs bf16 reference {vs_ref:.3e} (bar {REL_L2_VS_REFERENCE:g}), vs fp32 {vs_truth:.3e}")

    for name, (_, vs_truth) in report.items():
        assert vs_truth <= NOT_WORSE_THAN_BF16 * ref_err, (name, vs_truth, ref_err)
    assert np.array_equal(replay, out["graph"]), "graph replay is deterministic"
    assert np.array_equal(out["graph-sync"], out["graph"]), "the VAE on its side stream computes the same bits"
    assert np.array_equal(out["graph-host-canvas"], out["graph"]), "the pad in the VAE graph computes the same bits"
    assert np.array_equal(out["graph"], out["compiled"]), "graph replay == eager compiled engine"


def test_graphs_of_several_buckets_share_one_pool_and_replay_in_any_order(nano):
    """Batch sizes 1 and 2 are two graphs in one memory pool. Replaying them interleaved must give the
    same bits as their first runs and as the compiled engine without graphs, and the second capture
    must cost far less than a second private pool would."""
    from wamrt.engine import Engine, EngineConfig
    from wamrt.sample import sample_observation

    obs = [sample_observation(1), sample_observation(2)]
    eager = Engine.from_policy(nano, EngineConfig(cuda_graph=False))
    want1 = eager.infer_batch(obs[:1], seeds=[7])[0].actions
    want2 = [c.actions for c in eager.infer_batch(obs, seeds=[8, 9])]
    del eager
    engine = Engine.from_policy(nano, EngineConfig())
    engine.infer_batch(obs[:1], seeds=[7])
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_reserved()
    engine.infer_batch(obs, seeds=[8, 9])
    torch.cuda.synchronize()
    grown_gib = (torch.cuda.memory_reserved() - after_one) / 2**30
    for _ in range(2):
        got1 = engine.infer_batch(obs[:1], seeds=[7])[0].actions
        got2 = [c.actions for c in engine.infer_batch(obs, seeds=[8, 9])]
        assert np.array_equal(got1, want1)
        for g, w in zip(got2, want2, strict=True):
            assert np.array_equal(g, w)
    assert len(engine.graphs) == 2
    print(f"\nreserved memory grew {grown_gib:.2f} GiB for the batch-2 graph")


def test_prompt_buckets_one_graph_serves_two_prompt_lengths(nano):
    """With prompt buckets, two instructions of different token lengths replay one captured graph, bit for
    bit what the compiled engine without graphs computes for each, and within bf16 noise of the exact
    (unpadded, per-sequence attention) graph engine."""
    from wamrt.engine import Engine, EngineConfig
    from wamrt.pipeline.random_weights import FixedLengthTokenizer
    from wamrt.sample import sample_observation

    class VariableLength(FixedLengthTokenizer):
        """The benchmark tokenizer gives every instruction 125 tokens; here the length follows the text
        (115 and 119 tokens for the two DROID captions below: one 64-token bucket, two exact lengths)."""

        def encode(self, caption, system_prompt=None):
            self.cond_len = 70 + len(caption) // 8
            return super().encode(caption, system_prompt)

    tok = VariableLength(nano.model.config.vocab_size)

    def engine_with(**kw) -> Engine:
        return Engine(nano.model, nano.encoder, tok, nano.contract, nano.options, EngineConfig(**kw))

    obs = []
    for prompt in ("pick up the cube", "pick up the red cube and put it on the blue pad"):
        o = sample_observation(3)
        o["prompt"] = prompt
        obs.append(o)
    eager = engine_with(cuda_graph=False, prompt_bucket=64)
    want = [eager.infer(o, seed=4).actions for o in obs]
    del eager
    exact = engine_with()
    exact_out = [exact.infer(o, seed=4).actions for o in obs]
    assert len(exact.graphs) == 2  # what buckets avoid: one capture per prompt length
    del exact
    engine = engine_with(prompt_bucket=64)
    for _ in range(2):
        got = [engine.infer(o, seed=4).actions for o in obs]
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w)
    assert len(engine.graphs) == 1
    for g, e in zip(got, exact_out, strict=True):
        print(f"\nbucketed vs exact graph: rel L2 {rel_l2(g, e):.3e}")
        assert rel_l2(g, e) <= 0.1  # bf16 at random full depth: batching changes alone move ~3e-2


def test_isolated_requests_replay_bit_for_bit_at_any_position_and_company(nano):
    """isolate_requests (`wamrt serve --batch-invariant`): on the GPU a request's actions are bit-identical alone,
    with other requests, and at another position of the batch (CUDA graphs, prompt buckets: the served setup).
    Batched without isolation the same request is reported, not asserted: that difference is what isolation is for."""
    from wamrt.engine import Engine, EngineConfig
    from wamrt.sample import sample_observation

    engine = Engine.from_policy(nano, EngineConfig(prompt_bucket=64, isolate_requests=True))
    a, b, c = (sample_observation(i) for i in range(3))
    alone = engine.infer_batch([a], seeds=[5])[0].actions
    assert np.array_equal(alone, engine.infer_batch([b, a], seeds=[6, 5])[1].actions)
    assert np.array_equal(alone, engine.infer_batch([c, b, a], seeds=[7, 6, 5])[2].actions)
    assert np.array_equal(alone, engine.infer_batch([a, c], seeds=[5, 7])[0].actions)
    assert len(engine.graphs) == 1  # every request runs the one batch-1 graph
    batched = Engine.from_policy(nano, EngineConfig(prompt_bucket=64))
    rows = [batched.infer_batch(batch, seeds=seeds)[at].actions
            for batch, seeds, at in (([a], [5], 0), ([b, a], [6, 5], 1), ([c, b, a], [7, 6, 5], 2))]
    print(f"\nbatched, not isolated: the same request bit-identical at positions 1 and 2 of batches 2 and 3: "
          f"{[np.array_equal(rows[0], r) for r in rows[1:]]}")


def test_overlapped_encode_reads_each_requests_own_latent(nano):
    """The VAE encode runs on a side stream with no host sync (EngineConfig.overlap_encode): back-to-back requests
    with different observations, singly and as a batch of two, give the bits of the engine whose host waits for each
    encode -- a latent read before its encode finished, or a freed one reused, would not."""
    from wamrt.engine import Engine, EngineConfig
    from wamrt.sample import sample_observation

    obs = [sample_observation(i) for i in (3, 4, 5)]
    sync = Engine.from_policy(nano, EngineConfig(overlap_encode=False))
    want = [sync.infer(o, seed=11 + i).actions for i, o in enumerate(obs)]
    want_pair = [c.actions for c in sync.infer_batch(obs[:2], seeds=[20, 21])]
    del sync
    engine = Engine.from_policy(nano, EngineConfig())
    for _ in range(2):
        got = [engine.infer(o, seed=11 + i) for i, o in enumerate(obs)]
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g.actions, w)
            assert g.timings_ms["vae_encode"] > 0 and g.timings_ms["denoise"] > g.timings_ms["vae_encode"]
        pair = engine.infer_batch(obs[:2], seeds=[20, 21])
        for g, w in zip(pair, want_pair, strict=True):
            assert np.array_equal(g.actions, w)
