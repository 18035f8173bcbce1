"""The decode step replayed as a CUDA graph (with the model's layers, or the compiled ones of reasoner/fused.py)
computes what the eager step does (GPU only)."""

from __future__ import annotations

import pytest
import torch
from oracle.reasoner import build_tiny_reasoner

from wamrt.reasoner.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("fused", [False, True])
def test_graph_decode_equals_eager(tmp_path, fused: bool) -> None:
    # fused: the compiled decode layers (reasoner/fused.py) captured in the graphs
    tiny = build_tiny_reasoner(tmp_path, vision=False)
    r = tiny.reasoner
    r.lm.to("cuda")
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
