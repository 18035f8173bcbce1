"""Engine configurations on the CPU (tiny model, fp32) compute the eager reference's function."""

from __future__ import annotations

import numpy as np
import pytest
from oracle.graph_standin import record_by_rerun

from wamrt.engine import Engine, EngineConfig
from wamrt.sample import sample_observation

TOL = 2e-5  # fp32, different summation orders (batched GEMMs, per-sequence attention)
SHORT = "pick up the cube"
LONG = "pick up the red cube and put it on the blue pad, then push the green cylinder next to the yellow bowl"


# vae_frames=5 instead of the reference's 33: the same latent frame 0, at a fraction of the CPU time.
CONFIGS = {
    "E0": dict(attention="gqa", reuse_reasoner=False, vae_frames=5, batch_cfg=False),
    "E1": dict(attention="auto", reuse_reasoner=False, vae_frames=5, batch_cfg=False),
    "E2": dict(attention="auto", batch_cfg=False),
    "E3": dict(attention="auto", batch_cfg=True),
    "E3-mask": dict(attention="auto", batch_cfg=True, cfg_attention="mask"),
    # [Generator | prefix | zeros] keys; off fa4 one call per sequence on a prefix of its row
    "E3-lengths": dict(attention="auto", batch_cfg=True, cfg_attention="lengths"),
    # ... with K/V buffers at the model's K/V heads (SDPA repeats them per call here; fa4 shares them in the kernel)
    "E3-lengths-gqa": dict(attention="auto", batch_cfg=True, cfg_attention="lengths", gqa_buffers=True),
}


@pytest.mark.parametrize("row", list(CONFIGS))
def test_engine_rows_match_reference(policy, row):
    engine = Engine.from_policy(policy, EngineConfig(compile=False, cuda_graph=False, **CONFIGS[row]))
    # the second request carries committed rows (inpainted: tiny-droid was never trained with prefixes)
    obs = [sample_observation(0), dict(sample_observation(1), action_prefix=np.full((4, 8), 0.2, np.float32))]
    out = engine.infer_batch(obs, seeds=[3, 4], steps=2)  # 2 steps: CFG + the order-2 solver
    for o, seed, ob in zip(out, (3, 4), obs, strict=True):
        ref = policy.infer(ob, seed=seed, steps=2)
        assert np.abs(o.actions - ref.actions).max() <= TOL, row


def test_guidance_interval_and_kv_cache(policy):
    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    obs = sample_observation(2)
    for _ in range(2):  # the second request reuses both cached prompts
        got = engine.infer(obs, seed=9, steps=2, guidance_interval=(960, 1001))
    ref = policy.infer(obs, seed=9, steps=2, guidance_interval=(960, 1001))
    assert np.abs(got.actions - ref.actions).max() <= TOL
    assert engine.kv_cache.misses == 2 and engine.kv_cache.hits == 2


def test_canvas_padded_on_the_device_or_the_host_gives_the_same_bits(policy):
    obs = [sample_observation(0), sample_observation(1)]
    got = {}
    for on_device in (True, False):
        engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                         canvas_on_device=on_device))
        got[on_device] = [c.actions for c in engine.infer_batch(obs, seeds=[5, 6], steps=1)]
    for a, b in zip(got[True], got[False], strict=True):
        assert np.array_equal(a, b)


def test_bad_request_in_a_batch_does_not_sink_the_others(policy):
    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    bad = sample_observation(0)
    bad["observation/joint_position"] = [float("nan")] * 7
    good, err = engine.infer_batch([sample_observation(0), bad], seeds=[1, 1], steps=1)
    assert good.actions.shape == (32, 8)
    assert type(err).__name__ == "RequestError" and err.field == "observation/joint_position"


def test_server_seed_sequence_counts_a_failing_request(policy):
    """Seeds are drawn in request order before preprocessing, so a bad request in a batch consumes its seed
    exactly as it does one request at a time (the framework server's sequence)."""
    cfg = EngineConfig(attention="auto", compile=False, cuda_graph=False)
    batched, single = Engine.from_policy(policy, cfg), Engine.from_policy(policy, cfg)
    bad = sample_observation(0)
    bad["prompt"] = 7
    got = batched.infer_batch([sample_observation(0), bad, sample_observation(1)], steps=1)
    want = [single.next_seed() for _ in range(3)]
    assert type(got[1]).__name__ == "RequestError" and got[1].field == "prompt"
    assert (got[0].seed, got[2].seed) == (want[0], want[2])


def test_isolated_requests_do_not_depend_on_their_batch_mates_or_position(policy):
    """isolate_requests (`wamrt serve --batch-invariant`): a request's actions are bit-identical alone, with other
    requests, and at any position of the batch, and equal the reference within the usual tolerance. (Batched, on
    the CPU a row's position already matters by an ulp: the last block of rows takes another kernel.)"""
    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                     isolate_requests=True, prompt_bucket=64))
    a, b, c = sample_observation(0), _prompted(1, LONG), sample_observation(2)
    alone = engine.infer_batch([a], seeds=[5], steps=2)[0].actions
    for batch, seeds, at in (([a, b], [5, 6], 0), ([b, a], [6, 5], 1), ([c, b, a], [7, 6, 5], 2)):
        assert np.array_equal(engine.infer_batch(batch, seeds=seeds, steps=2)[at].actions, alone), at
    assert np.abs(alone - policy.infer(a, seed=5, steps=2).actions).max() <= TOL
    assert engine.metadata()["engine"]["isolate_requests"] is True


def test_isolated_requests_never_replay_a_larger_graph(policy):
    """A compatible larger graph would pad an isolated request to another width (other bits): it gets its own."""
    graphs = _graph_engine(policy, prompt_bucket=64, isolate_requests=True)
    with graphs.capturing_exact_buckets():  # warm-up at the wide bucket
        graphs.infer(_prompted(0, LONG), seed=1, steps=2)
    first = graphs.infer(_prompted(2, SHORT), seed=6, steps=2).actions
    widths = sorted(k.width for k in graphs.graphs)
    assert len(widths) == 2 and widths[0] < widths[1]  # the short prompt captured its own narrower graph
    assert np.array_equal(graphs.infer(_prompted(2, SHORT), seed=6, steps=2).actions, first)
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    assert np.abs(first - eager.infer(_prompted(2, SHORT), seed=6, steps=2).actions).max() <= TOL
    assert graphs.graphs.compatible_hits == 0 and graphs.graphs.captures == 2


def test_cuda_graph_needs_cuda(policy):
    with pytest.raises(ValueError, match="CUDA"):
        Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=True))


def test_euler_solver_option_is_honoured(policy):
    from wamrt.pipeline import SamplingOptions

    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    obs = sample_observation(3)
    # 3 steps: UniPC runs an order-2 step there (at 2 steps both solvers are first order, i.e. equal).
    got = engine.infer(obs, seed=2, steps=3, solver="euler")
    ref = policy.infer(obs, seed=2, steps=3, solver="euler")
    unipc = policy.infer(obs, seed=2, steps=3)
    assert np.abs(got.actions - ref.actions).max() <= TOL
    assert np.abs(unipc.actions - ref.actions).max() > 1e-3  # the solver really changed
    assert SamplingOptions().solver == "unipc"


def test_compiled_engine_matches_and_leaves_the_shared_model_uncompiled(policy):
    """The production path (fused + regional torch.compile) equals the uncompiled engine, and compiling
    one engine does not change what another engine or the eager Policy on the same model runs."""
    import types

    obs = sample_observation(3)
    plain = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    want = plain.infer(obs, seed=11, steps=2).actions
    compiled = Engine.from_policy(policy, EngineConfig(attention="auto", compile=True, cuda_graph=False))
    got = compiled.infer(obs, seed=11, steps=2).actions
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    for layer in policy.model.layers:
        assert isinstance(layer.generator_post, types.MethodType)  # not a compiled wrapper on the model
    assert np.array_equal(plain.infer(obs, seed=11, steps=2).actions, want)


def _prompted(i: int, prompt: str) -> dict:
    obs = sample_observation(i)
    obs["prompt"] = prompt
    return obs


def test_prompt_buckets_compute_the_exact_function_and_share_one_key(policy):
    """Prefixes padded to a bucket with masked keys give the exact engine's actions, and prompts of different
    lengths inside one bucket get the same graph key (one capture serves them all on the GPU)."""
    short, longer = "pick up the cube", "pick up the red cube and put it on the blue pad"
    exact = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    bucketed = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                       prompt_bucket=64))
    obs = [_prompted(0, short), _prompted(1, longer)]
    for kw in (dict(steps=2), dict(steps=2, guidance_interval=(960, 1001))):  # CFG + cond-only step kinds
        want = exact.infer_batch(obs, seeds=[3, 4], **kw)
        got = bucketed.infer_batch(obs, seeds=[3, 4], **kw)
        for g, w in zip(got, want, strict=True):
            assert np.abs(g.actions - w.actions).max() <= TOL, kw

    keys, cond_lengths = [], []
    for prompt in (short, longer):
        prep = bucketed.infer(_prompted(0, prompt), seed=1, steps=1)  # fills the Reasoner cache
        assert prep.actions.shape == (32, 8)
        conds, unconds = bucketed._sequences([_inputs(bucketed, prompt)], True)
        lengths = [s.kv.length for s in conds + unconds]
        p_conds, p_unconds = bucketed._pad_prefixes(conds, unconds)
        padded = p_conds + p_unconds
        assert bucketed._pad_prefixes(conds, unconds)[0][0].kv is p_conds[0].kv  # padded once per prompt
        assert len({s.kv.length for s in padded}) == 1 and padded[0].kv.length % 64 == 0
        assert [int(s.kv.key_mask.sum()) for s in padded] == lengths  # the real tokens, nothing else
        keys.append(bucketed._bucket_lengths(p_conds, p_unconds))
        cond_lengths.append(lengths[0])
        assert exact._bucket_lengths(conds, unconds) == tuple(lengths)
    assert cond_lengths[0] != cond_lengths[1]
    assert keys[0] == keys[1], "two prompt lengths in one bucket must share a graph key"
    assert bucketed.metadata()["engine"]["prompt_bucket"] == 64


def _inputs(engine: Engine, prompt: str):
    from wamrt.pipeline.droid import prepare_droid

    return prepare_droid(_prompted(0, prompt), model=engine.model, encoder=engine.encoder,
                         tokenizer=engine.tokenizer, contract=engine.contract, seed=0, device=engine.device).inputs


def test_cfg_attention_is_checked_and_auto_picks_lengths_on_fa4_only(policy, monkeypatch):
    with pytest.raises(ValueError, match="cfg_attention must be one of"):
        Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                cfg_attention="varlen"))
    plain = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    assert plain.metadata()["engine"]["cfg_attention"] == "split"
    import wamrt.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "fa4_available", lambda device=None: True)  # construction only, no call
    fa4 = Engine.from_policy(policy, EngineConfig(attention="fa4", compile=False, cuda_graph=False))
    assert fa4.metadata()["engine"]["cfg_attention"] == "lengths"


def test_prompt_bucket_configuration_is_checked(policy):
    with pytest.raises(ValueError, match="prompt_bucket must be >= 0"):
        Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False, prompt_bucket=-1))
    with pytest.raises(ValueError, match="batch_cfg"):
        Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False, prompt_bucket=32,
                                                batch_cfg=False))


class RerunGraphEngine(Engine):
    def _record(self, entry, run):
        return record_by_rerun(entry, run)


def _graph_engine(policy, **kw) -> Engine:
    from dataclasses import replace

    engine = RerunGraphEngine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                               **kw))
    engine.config = replace(engine.config, cuda_graph=True)  # the graph path, minus the CUDA check
    return engine


@pytest.mark.parametrize("layout", [dict(cfg_attention="split"), dict(cfg_attention="lengths"),
                                    dict(cfg_attention="lengths", gqa_buffers=True)])
def test_graph_path_static_inputs_arena_and_buckets_on_cpu(policy, layout):
    """The capture/replay bookkeeping (static inputs, K/V arena sized by KVBufferArena.elements, one entry per
    bucket) without a GPU: batch sizes 2 and 1 and both step kinds, interleaved, equal the eager engine; in both
    K/V layouts (prefix first, Generator first)."""
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    graphs = _graph_engine(policy, **layout)
    obs = [sample_observation(0), sample_observation(1)]
    for kw in (dict(steps=2), dict(steps=2, guidance_interval=(960, 1001))):
        want2 = [c.actions for c in eager.infer_batch(obs, seeds=[3, 4], **kw)]
        want1 = eager.infer_batch(obs[1:], seeds=[5], **kw)[0].actions
        for _ in range(2):  # capture, then replay, in alternating buckets
            got2 = [c.actions for c in graphs.infer_batch(obs, seeds=[3, 4], **kw)]
            got1 = graphs.infer_batch(obs[1:], seeds=[5], **kw)[0].actions
            for g, w in zip(got2 + [got1], want2 + [want1], strict=True):
                assert np.abs(g - w).max() <= TOL, kw
    assert len(graphs.graphs) == 4  # 2 batch sizes x 2 guidance patterns


def test_gqa_buffers_hold_the_kv_heads_only(policy):
    """With gqa_buffers the K/V arena (every step buffer of a captured loop) is sized for the model's K/V heads."""
    cfg = policy.model.config
    obs = [sample_observation(0), sample_observation(1)]
    arenas = {}
    for gqa in (False, True):  # per-layer buffers: shared ones keep the prefixes at the K/V heads either way
        engine = _graph_engine(policy, cfg_attention="lengths", gqa_buffers=gqa, shared_kv_buffer=False)
        engine.infer_batch(obs, seeds=[3, 4], steps=1)
        arenas[gqa] = engine.kv_arena.arena.shape[-1]
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert arenas[True] * cfg.num_attention_heads == arenas[False] * cfg.num_key_value_heads


def test_prompt_bucket_graph_replays_a_new_prompt_length_correctly_on_cpu(policy):
    """One bucketed graph, captured for a short instruction, replayed for a longer one, gives the longer
    one's exact actions (its K/V, rope and key mask all refreshed); without buckets that is a 2nd graph."""
    short, longer = "pick up the cube", "pick up the red cube and put it on the blue pad"
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    bucketed, exact = _graph_engine(policy, prompt_bucket=64), _graph_engine(policy)
    for prompt in (short, longer, short):
        want = eager.infer(_prompted(2, prompt), seed=6, steps=2).actions
        for engine in (bucketed, exact):
            got = engine.infer(_prompted(2, prompt), seed=6, steps=2).actions
            assert np.abs(got - want).max() <= TOL, prompt
    assert len(bucketed.graphs) == 1 and len(exact.graphs) == 2




def test_graph_key_does_not_depend_on_the_order_requests_arrive_in(policy):
    """Exact prefix lengths: [short, long] and [long, short] replay one graph, each request its own actions."""
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    graphs = _graph_engine(policy)
    obs = [_prompted(0, SHORT), _prompted(1, LONG)]
    want = [c.actions for c in eager.infer_batch(obs, seeds=[3, 4], steps=2)]
    got = [c.actions for c in graphs.infer_batch(obs, seeds=[3, 4], steps=2)]
    swapped = [c.actions for c in graphs.infer_batch(obs[::-1], seeds=[4, 3], steps=2)][::-1]
    for g, s, w in zip(got, swapped, want, strict=True):
        assert np.abs(g - w).max() <= TOL and np.abs(s - w).max() <= TOL
    assert len(graphs.graphs) == 1 and graphs.graphs.captures == 1


def test_a_missing_bucket_replays_a_larger_captured_one_without_a_capture(policy):
    """Prompt buckets: after warm-up captured batch 2 at the long prompt's width, a single request, and a short
    prompt of a narrower bucket, replay that graph (spare row, wider masked prefix) with their own actions."""
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    graphs = _graph_engine(policy, prompt_bucket=64)
    with graphs.capturing_exact_buckets():
        graphs.infer_batch([_prompted(0, LONG), _prompted(1, LONG)], seeds=[1, 2], steps=2)
    (captured,) = list(graphs.graphs)
    assert captured.batch == 2 and captured.width > graphs._padded_length(len(SHORT))
    for prompt in (LONG, SHORT):
        want = eager.infer(_prompted(2, prompt), seed=6, steps=2).actions
        got = graphs.infer(_prompted(2, prompt), seed=6, steps=2).actions
        assert np.abs(got - want).max() <= TOL, prompt
    assert graphs.graphs.captures == 1 and graphs.graphs.compatible_hits == 2
    assert graphs.metadata()["engine"]["graphs"] == [captured.describe()]
    with graphs.capturing_exact_buckets():  # warm-up mode: the exact bucket is captured instead
        graphs.infer(_prompted(2, SHORT), seed=6, steps=2)
    assert graphs.graphs.captures == 2


def test_an_evicted_bucket_is_recaptured_and_still_correct(policy):
    """graph_cache_size=1: alternating batch sizes evict each other (counted), and every replay after an eviction
    still gives the eager engine's actions."""
    eager = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    graphs = _graph_engine(policy, prompt_bucket=64, graph_cache_size=1)
    obs = [_prompted(0, SHORT), _prompted(1, LONG)]
    want2 = [c.actions for c in eager.infer_batch(obs, seeds=[3, 4], steps=2)]
    want1 = eager.infer(obs[1], seed=5, steps=2).actions
    with graphs.capturing_exact_buckets():  # exact buckets: a batch of 1 must not replay the batch-2 graph
        for _ in range(2):
            got2 = [c.actions for c in graphs.infer_batch(obs, seeds=[3, 4], steps=2)]
            got1 = graphs.infer(obs[1], seed=5, steps=2).actions
            for g, w in zip(got2 + [got1], want2 + [want1], strict=True):
                assert np.abs(g - w).max() <= TOL
    assert len(graphs.graphs) == 1 and graphs.graphs.captures == 4 and graphs.graphs.evictions == 3


def test_server_exports_the_graph_cache_metrics_and_buckets(policy):
    import httpx

    from wamrt.serving import ServeConfig, ServerThread

    engine = _graph_engine(policy, prompt_bucket=64)
    with ServerThread(engine, ServeConfig(max_batch=2)) as server:
        text = httpx.get(server.http_url + "/metrics").text
        meta = httpx.get(server.http_url + "/v1/policy/metadata").json()
    stats = engine.graph_stats()
    assert stats["captures"] == 2 and stats["entries"] == 2  # warm-up: batch sizes 2 and 1, exact
    assert "wamrt_graph_captures_total 2.0" in text and "wamrt_graph_cache_entries 2.0" in text
    assert "wamrt_graph_evictions_total 0.0" in text and "wamrt_graph_capture_seconds_count 2.0" in text
    # CPU: no allocator pool to read; the held graphs' static inputs (and the K/V arena) are counted exactly
    held = stats["bytes"] + stats["arena_bytes"]
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("wamrt_graph")}
    assert values["wamrt_graph_pool_bytes"] == 0.0 and values["wamrt_graph_cache_bytes"] == held > 0
    assert sorted(g["batch"] for g in meta["policy"]["engine"]["graphs"]) == [1, 2]


def test_compile_mode_is_checked_and_reported(policy):
    with pytest.raises(ValueError, match="compile_mode"):
        Engine.from_policy(policy, EngineConfig(attention="auto", cuda_graph=False, compile_mode="reduce-overhead"))
    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                     compile_mode="max-autotune-no-cudagraphs"))
    assert engine.metadata()["engine"]["compile_mode"] == "max-autotune-no-cudagraphs"


@pytest.mark.parametrize("config", [dict(), dict(cfg_attention="lengths"), dict(cfg_attention="mask"),
                                    dict(prompt_bucket=16)], ids=["split", "lengths", "mask", "bucket"])
def test_last_layer_runs_the_rows_whose_output_is_read(policy, config):
    """EngineConfig.last_layer_read_rows: after its K/V stores the last layer (attention, output projection, MLP) and
    the output run without the observation's clean latent frame at every step, and on the action rows alone at the
    last one. The actions are those of the full pass, and so are the velocities of every step before the last (the
    clean frame's as zeros, as the full pass masks it). Also with CFG off at the last step (a guidance interval),
    where that step runs the conditional branch only."""
    obs = [sample_observation(0), sample_observation(1)]
    last_layer = policy.model.layers[-1]
    for kwargs in (dict(steps=2), dict(steps=3, guidance_interval=(960, 1001))):
        actions, rows_seen, velocities = {}, {}, {}
        for pruned in (True, False):
            engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False,
                                                             last_layer_read_rows=pruned, **config))
            seen: list[int] = []
            vels: list = []
            post, step_velocities = engine._post, engine._velocities

            def counting_post(layer, g, o, post=post, seen=seen):
                if layer is last_layer:
                    seen.append(g.shape[1])
                return post(layer, g, o)

            def recording(*args, step_velocities=step_velocities, vels=vels, **kw):
                vels.append(out := step_velocities(*args, **kw))
                return out

            engine._post, engine._velocities = counting_post, recording
            actions[pruned] = [o.actions for o in engine.infer_batch(obs, seeds=[3, 4], **kwargs)]
            rows_seen[pruned], velocities[pruned] = seen, vels
        steps = kwargs["steps"]
        full = rows_seen[False][0]
        assert rows_seen[False] == [full] * steps
        frames = velocities[False][0].vision.shape[2]
        chunk_rows = policy.contract.history + policy.contract.chunk
        frame_rows = (full - chunk_rows) // frames
        assert rows_seen[True] == [full - frame_rows] * (steps - 1) + [chunk_rows] and 0 < frame_rows < full
        for got, want in zip(actions[True], actions[False], strict=True):
            assert np.abs(got - want).max() <= TOL, kwargs
        for step, (got, want) in enumerate(zip(velocities[True], velocities[False], strict=True)):
            assert (got.action - want.action).abs().max() <= TOL
            if step == steps - 1:
                assert got.vision is None and want.vision is not None
            else:
                assert got.vision.shape == want.vision.shape and (got.vision - want.vision).abs().max() <= TOL
                assert not got.vision[:, :, 0].any() and want.vision[:, :, 1:].abs().max() > 0


PREFIX_TOL = 1e-5  # a reply's prefix rows vs the request's (float32 rounding)


def test_one_graph_serves_every_prefix_length_and_mode(policy):
    """`action_prefix` requests with d = 0, 3, 10, clean and inpainted, on one engine: one capture (the clean mask and
    the anchored rows are static inputs refreshed on every replay, not part of the key), every reply equal to the
    eager reference's and starting with its prefix."""
    graphs = _graph_engine(policy)
    obs = sample_observation(1)
    plain = policy.infer(obs, seed=4, steps=2).actions
    for d, mode in ((0, None), (3, "inpaint"), (10, "clean"), (3, "clean"), (10, "inpaint"), (0, None)):
        req = obs if d == 0 else dict(obs, action_prefix=plain[:d] + 0.05, action_prefix_mode=mode)
        want = policy.infer(req, seed=4, steps=2).actions
        got = graphs.infer(req, seed=4, steps=2)
        assert np.abs(got.actions - want).max() <= TOL, (d, mode)
        assert (got.prefix_rows, got.prefix_mode) == (d, mode)
        if d:
            assert np.abs(got.actions[:d] - req["action_prefix"]).max() <= PREFIX_TOL
    assert graphs.graphs.captures == 1


def test_prefixed_and_plain_requests_share_a_batch_and_a_larger_graph(policy):
    """Requests with different d (and none) in one batch, and a single prefixed request replaying the larger batch
    graph (its spare row grown from the request, masks and anchors included), each equal to the eager reference."""
    graphs = _graph_engine(policy, prompt_bucket=64)
    a, b = _prompted(0, LONG), _prompted(1, SHORT)
    a.update(action_prefix=np.full((5, 8), 0.1, np.float32), action_prefix_mode="clean")
    with graphs.capturing_exact_buckets():
        got = graphs.infer_batch([a, b], seeds=[1, 2], steps=2)
    for g, req, seed in zip(got, (a, b), (1, 2), strict=True):
        assert np.abs(g.actions - policy.infer(req, seed=seed, steps=2).actions).max() <= TOL
    c = dict(_prompted(2, SHORT), action_prefix=np.full((12, 8), -0.1, np.float32), action_prefix_mode="inpaint")
    single = graphs.infer(c, seed=6, steps=2).actions
    assert np.abs(single - policy.infer(c, seed=6, steps=2).actions).max() <= TOL
    assert np.abs(single[:12] - c["action_prefix"]).max() <= PREFIX_TOL
    assert graphs.graphs.captures == 1 and graphs.graphs.compatible_hits == 1


def test_prepared_host_inputs_give_the_same_actions_as_the_observations(policy):
    """A caller may validate and compose canvases itself (`droid_host_inputs` with the engine's contract: the grid's
    simulator processes do): the engine takes them as they are and computes the same actions, bit for bit; a bad
    observation beside them still gets its own error."""
    from wamrt.pipeline.droid import DroidHostInputs, droid_host_inputs

    engine = Engine.from_policy(policy, EngineConfig(attention="auto", compile=False, cuda_graph=False))
    obs = [sample_observation(0), dict(sample_observation(1), action_prefix=np.full((3, 8), 0.1, np.float32))]
    want = engine.infer_batch(obs, seeds=[5, 6], steps=1)
    prepared = [droid_host_inputs(o, engine.contract) for o in obs]
    bad = dict(sample_observation(2), prompt=7)
    got = engine.infer_batch([*prepared, bad], seeds=[5, 6, 7], steps=1)
    assert all(isinstance(p, DroidHostInputs) for p in prepared)
    for w, g in zip(want, got[:2], strict=True):
        assert np.array_equal(w.actions, g.actions) and w.prefix_rows == g.prefix_rows
    assert type(got[2]).__name__ == "RequestError" and got[2].field == "prompt"
