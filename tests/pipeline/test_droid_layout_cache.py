"""The DROID packer's cached pieces: positions per layout, the constant masks, and the engine's RoPE tables per
layout. A cache must hand out exactly what a fresh computation gives, share nothing across different layouts,
and never be written to by its consumers."""

from __future__ import annotations

import torch

from wamrt.model.config import get_config
from wamrt.pipeline.droid import DroidContract, _droid_positions, droid_branch


def test_positions_are_shared_per_layout_and_equal_a_fresh_computation() -> None:
    cfg, contract = get_config("tiny-qwen"), DroidContract()
    a = droid_branch(cfg, tuple(range(12)), (3, 6, 8), contract)
    b = droid_branch(cfg, tuple(range(100, 112)), (3, 6, 8), contract)  # other ids, same length
    c = droid_branch(cfg, tuple(range(13)), (3, 6, 8), contract)
    d = droid_branch(cfg, tuple(range(12)), (3, 8, 8), contract)
    assert a.positions is b.positions and a.layout == b.layout
    assert not torch.equal(a.input_ids, b.input_ids)
    for other in (c, d):
        assert other.layout != a.layout and other.positions.shape != a.positions.shape
    fresh = _droid_positions.__wrapped__(cfg, a.layout, "cpu")
    assert torch.equal(a.positions, fresh) and fresh is not a.positions


def test_cached_tensors_made_under_inference_mode_still_serve_autograd() -> None:
    cfg, contract = get_config("tiny-qwen"), DroidContract()
    ids = tuple(range(21))  # a layout no other test uses, so the first call here fills the cache
    with torch.inference_mode():
        first = droid_branch(cfg, ids, (2, 4, 6), contract)
    assert not first.positions.is_inference()
    weight = torch.ones(1, requires_grad=True)
    (droid_branch(cfg, ids, (2, 4, 6), contract).positions * weight).sum().backward()  # saved for backward
    assert weight.grad is not None


def test_engine_rope_tables_are_cached_per_layout() -> None:
    from wamrt.engine import Engine, EngineConfig
    from wamrt.pipeline.policy import random_policy
    from wamrt.sample import sample_observation

    policy = random_policy("tiny-qwen", torch.device("cpu"), torch.float32, tiny_vae=True)
    engine = Engine.from_policy(policy, EngineConfig(compile=False, cuda_graph=False, attention="auto"))
    obs = sample_observation(0)
    first = engine.infer(obs, seed=3).actions
    assert len(engine._ropes) == 2  # the conditional and the unconditional layout
    tables = {k: (v.cos.clone(), v.sin.clone()) for k, v in engine._ropes.items()}
    second = engine.infer(obs, seed=3).actions
    assert (first == second).all() and len(engine._ropes) == 2
    for key, rope in engine._ropes.items():  # nobody wrote into a shared table
        assert torch.equal(rope.cos, tables[key][0]) and torch.equal(rope.sin, tables[key][1])
