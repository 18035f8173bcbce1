"""engine/stage_clock.py off CUDA (wall time), and the Reasoner cache's host key: no device read-back."""

from __future__ import annotations

import time

import torch

from wamrt.engine.stage_clock import StageClock


def test_cpu_stages_are_wall_time_and_only_stopped_ones_count():
    clock = StageClock(torch.device("cpu"))
    clock.start("a")
    time.sleep(0.02)
    clock.stop("a")
    clock.start("b")  # never stopped
    ms = clock.ms()
    assert set(ms) == {"a"} and 15 <= ms["a"] < 1000


def test_reasoner_cache_uses_the_host_key_when_given():
    from wamrt.engine.prefix_cache import ReasonerCache
    from wamrt.model import Cosmos3Transformer, get_config
    from wamrt.pipeline.droid import DroidContract, droid_branch

    cfg = get_config("tiny-qwen")
    model = Cosmos3Transformer(cfg).eval()
    branch = droid_branch(cfg, (5, 6, 7), (2, 4, 4), DroidContract())
    assert branch.token_key == (5, 6, 7)
    cache = ReasonerCache(model, 4)
    with torch.inference_mode():
        kv = cache.get(branch.input_ids, branch.positions, branch.token_key)

        class NoReadBack(torch.Tensor):  # any tolist() on the ids would be a device read-back on CUDA
            def tolist(self):
                raise AssertionError("read back")

        ids = branch.input_ids.as_subclass(NoReadBack)
        assert cache.get(ids, branch.positions, branch.token_key) is kv and cache.hits == 1
        assert cache.get(branch.input_ids, branch.positions) is kv and cache.hits == 2  # without: read back, same key
