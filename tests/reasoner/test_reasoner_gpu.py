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


def test_chat_worker_precaptures_every_bucket_on_the_gpu(tmp_path) -> None:
    """The chat thread's captures while idle (serving/chat_worker.py) on real CUDA graphs: every bucket captured
    ahead, then a chat decodes the eager path's tokens without capturing on a step."""
    import time

    from wamrt.serving.batcher import DeviceGate
    from wamrt.serving.chat_worker import ChatWorker

    tiny = build_tiny_reasoner(tmp_path, vision=False)
    r = tiny.reasoner
    r.lm.to("cuda")
    prompt = r.prepare([{"role": "user", "content": "A longer prompt about robots."}])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    worker = ChatWorker(r, DeviceGate(), max_batch=2, max_queue=4, precapture_when=lambda: True)
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
