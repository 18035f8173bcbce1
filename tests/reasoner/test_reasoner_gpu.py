"""The decode step replayed as a CUDA graph (with the model's layers, or the compiled ones of reasoner/fused.py)
computes what the eager step does (GPU only)."""

from __future__ import annotations

import pytest
import torch
from oracle.reasoner import build_tiny_reasoner

from wamrt.reasoner.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("fused,fuse_weights", [(False, False), (True, False), (True, True)])
def test_graph_decode_equals_eager(tmp_path, fused: bool, fuse_weights: bool) -> None:
    # fused: the compiled decode layers (reasoner/fused.py) captured in the graphs; fuse_weights: over one matrix for
    # q/k/v and one for gate/up (engine/fuse.py fuse_reasoner), on both sides
    tiny = build_tiny_reasoner(tmp_path, vision=False)
    r = tiny.reasoner
    r.lm.to("cuda")
    if fuse_weights:
        from wamrt.engine.fuse import fuse_reasoner

        fuse_reasoner(r.lm.transformer)
    prompts = [r.prepare([{"role": "user", "content": t}]) for t in ("Hi there.", "A longer prompt about robots.")]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        done = {}
        for events in r.generate(prompts, params, cuda_graphs=graphs, fused=fused and graphs):
            for e in events:
                if e.finish_reason:
                    done[e.seq.tag] = e.seq.tokens
        runs[graphs] = [done[0], done[1]]
    assert runs[True] == runs[False]


@pytest.mark.parametrize("one_row", [False, True])
def test_chat_worker_precaptures_every_bucket_on_the_gpu(tmp_path, one_row: bool) -> None:
    """The chat thread's captures while idle (serving/chat_worker.py) on real CUDA graphs: every bucket captured
    ahead, then a chat decodes the eager path's tokens without capturing on a step; also with `--chat-decode
    one-row` (`OneRowDecode` in the one-row buckets' graphs)."""
    import time

    from wamrt.serving.batcher import DeviceGate
    from wamrt.serving.chat_worker import ChatWorker

    tiny = build_tiny_reasoner(tmp_path, vision=False)
    r = tiny.reasoner
    r.lm.to("cuda")
    prompt = r.prepare([{"role": "user", "content": "A longer prompt about robots."}])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    worker = ChatWorker(r, DeviceGate(), max_batch=2, max_queue=4, precapture_when=lambda: True, one_row=one_row)
    try:
        deadline = time.monotonic() + 300
        while worker.graphs_planned == 0 or worker.graphs_precaptured < worker.graphs_planned:
            assert time.monotonic() < deadline, worker.stats()
            time.sleep(0.05)
        text, _, _ = worker.run(prompt, params)
    finally:
        worker.stop()
    eager = list(r.generate([prompt], params, cuda_graphs=False))[-1][0].seq
    assert text == eager.stream.text and worker.stats()["graphs"]["captured_on_request"] == 0


def _kernel_shape_lm(weights: str):
    """A bf16 Reasoner on the GPU whose every matrix the Triton GEMVs take (K a multiple of 1,024); q/k/v and gate/up
    fused (`weights="fused"`) or the model's separate matrices (a served model's)."""
    import dataclasses

    from wamrt.engine.fuse import fuse_reasoner
    from wamrt.model import Cosmos3Transformer
    from wamrt.model.checkpoint import init_random_
    from wamrt.model.config import get_config
    from wamrt.reasoner.lm import ReasonerLM

    cfg = dataclasses.replace(get_config("tiny-qwen"), hidden_size=1024, intermediate_size=3072, num_hidden_layers=3,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=128, rope_axes_dim=(24, 20, 20),
                              vocab_size=4096)
    transformer = init_random_(Cosmos3Transformer(cfg), seed=3).eval().requires_grad_(False)
    head = torch.nn.Linear(1024, 4096, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=1024 ** -0.5)
    lm = ReasonerLM(transformer, head).to("cuda", torch.bfloat16)
    if weights == "fused":
        fuse_reasoner(lm.transformer)
    return lm


@pytest.mark.parametrize("weights", ["fused", "separate"])
def test_one_row_decode_in_graphs_replays_its_eager_steps_on_the_kernels(weights: str) -> None:
    """`DecodeBatch(one_row=True)` at kernel shapes (every GEMV on Triton, with PDL and its preloaded weight slices
    where the device has them, as `--chat-decode one-row` runs it): the captured steps decode, token for token, what
    the same stack decodes eagerly. The tiny fp32 chat tests never reach the kernels."""
    from wamrt.reasoner.engine import DecodeBatch, Reasoner
    from wamrt.reasoner.prompt import PreparedPrompt

    lm = _kernel_shape_lm(weights)
    reasoner = Reasoner(lm, None, max_len=128)
    ids = [5, 17, 900, 3, 64, 2048, 7, 11, 1000, 42]
    prompt = PreparedPrompt(ids, torch.arange(len(ids), dtype=torch.float32).expand(3, -1), len(ids), [], None)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        batch = DecodeBatch(reasoner, 1, cuda_graphs=graphs, one_row=True)
        seq = batch.admit(prompt, params).seq
        while batch.live:
            batch.step()
        tokens[graphs] = seq.tokens
    assert len(tokens[True]) == 24 and tokens[True] == tokens[False]


@pytest.mark.parametrize(("fold", "attention", "weights"), [(False, "sdpa", "fused"), (True, "sdpa", "fused"),
                                                      (True, "split", "fused"), (False, "split", "separate")])
def test_one_row_gemv_stack_equals_the_fused_layers_at_kernel_shapes(fold: bool, attention: str, weights: str) -> None:
    """`OneRowDecode` on the Triton kernels (bf16, K a multiple of 1,024, so every GEMV runs on them) against the
    per-layer fused decode with cuBLAS, same weights and cache: the logits of a few steps within the fused GEMVs'
    rounding, the same cache written; with `fold`, the norms folded into the matrices (after the reference ran); with
    the split attention kernel, the q/k norms and RoPE inside it on the one-row side; with separate q/k/v and
    gate/up matrices (a served model's), one GEMV each into its slice of the layer's buffer."""
    from wamrt.engine.fuse import fold_reasoner_norms
    from wamrt.ops.gemv import use_gemv_kernel
    from wamrt.reasoner.fused import FusedDecodeLayer, OneRowDecode
    from wamrt.reasoner.lm import KVCache

    lm = _kernel_shape_lm(weights)
    cfg = lm.transformer.config
    caches, logits = {}, {}
    with torch.no_grad():
        for name, layer_fn in (("layers", FusedDecodeLayer()), ("one_row", OneRowDecode())):
            if name == "one_row":
                use_gemv_kernel(lm)
                if fold:
                    assert fold_reasoner_norms(lm.transformer, lm.lm_head) == 2 * cfg.num_hidden_layers + 1
            cache = caches[name] = KVCache.empty(lm.transformer, 1, 64)
            steps = []
            for pos, token in enumerate((5, 17, 900, 3)):
                index = torch.tensor([pos], device="cuda")
                steps.append(lm.decode_step(cache, torch.tensor([token], device="cuda"), index,
                                            index.float(), 64, layer_fn, attention))
            logits[name] = torch.cat(steps)
    scale = logits["layers"].abs().max().item()
    assert (logits["one_row"] - logits["layers"]).abs().max().item() <= 0.05 * scale
    for a, b in ((caches["one_row"].keys, caches["layers"].keys), (caches["one_row"].values, caches["layers"].values)):
        assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.05)
