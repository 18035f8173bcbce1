"""cfg_combine dtype/op-order semantics and the strict guidance interval."""

from __future__ import annotations

import pytest
import torch

from wamrt.sampler import cfg_combine, guidance_active


def test_formula_fp32() -> None:
    c, u = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 2.0, 1.0])
    assert torch.equal(cfg_combine(c, u, 3.0), torch.tensor([2.0, 2.0, -5.0]))
    assert torch.equal(cfg_combine(c, u, 1.0), c)


def test_bf16_rounds_after_each_op() -> None:
    g = torch.Generator().manual_seed(0)
    c, u = torch.randn(8192, generator=g).bfloat16(), torch.randn(8192, generator=g).bfloat16()
    out = cfg_combine(c, u, 3.0)
    assert out.dtype == torch.bfloat16
    stepwise = (u.float() + ((c.float() - u.float()).bfloat16().float() * 3.0).bfloat16().float()).bfloat16()
    assert torch.equal(out, stepwise)
    # Combining in fp32 and rounding once is a different (more accurate) result: callers must pick.
    once = (u.float() + 3.0 * (c.float() - u.float())).bfloat16()
    assert not torch.equal(out, once)


def test_rejects_mixed_dtypes_and_tensor_guidance() -> None:
    with pytest.raises(ValueError):
        cfg_combine(torch.zeros(2), torch.zeros(2).bfloat16(), 3.0)
    with pytest.raises(TypeError):
        cfg_combine(torch.zeros(2), torch.zeros(2), torch.tensor(3.0))  # type: ignore[arg-type]


def test_guidance_interval_is_strict() -> None:
    ts = [999, 937, 833, 624]
    assert guidance_active(ts, None) == [True] * 4
    assert guidance_active(torch.tensor(ts), (960, 1001)) == [True, False, False, False]
    assert guidance_active(ts, (937, 1000)) == [True, False, False, False]  # 937 excluded
    assert guidance_active(ts, (624, 999)) == [False, True, True, False]  # both ends excluded
    assert guidance_active(ts, [0, 2000]) == [True] * 4
    assert guidance_active([], None) == []
