"""Prompt-bucket attention: zero-key padding removed by log-sum-exp rescaling equals exact attention."""

from __future__ import annotations

import pytest
import torch

from wamrt.ops.attention import KeyMaskAttention, ZeroKeyAttention, rescale_zero_keys, sdpa, sdpa_with_lse

FP32_TOL = 1e-5  # relative L2; fp32 with another summation order


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def padded_batch(real: list[int], width: int, gen_len: int, heads: int = 4, kv_heads: int = 2, d: int = 16,
                 queries: int = 24, logit_scale: float = 1.0, seed: int = 0):
    """q, left-zero-padded K/V [S, K, width + gen_len, d] and the validity mask, like the engine's buffers."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(real), heads, queries, d, generator=g) * logit_scale
    k = torch.randn(len(real), kv_heads, width + gen_len, d, generator=g)
    v = torch.randn(len(real), kv_heads, width + gen_len, d, generator=g)
    pos = torch.arange(width + gen_len)
    valid = torch.stack([pos >= width - n for n in real])
    k[~valid[:, None, :, None].expand_as(k)] = 0.0
    v[~valid[:, None, :, None].expand_as(v)] = 0.0
    return q, k, v, valid


def exact(q, k, v, valid):
    """Each sequence on its real keys only, unmasked."""
    return torch.cat([sdpa(q[b : b + 1], k[b : b + 1, :, valid[b]], v[b : b + 1, :, valid[b]], causal=False,
                           backend="math") for b in range(q.shape[0])])


@pytest.mark.parametrize("real", [[5, 17, 32], [32, 32], [1, 30]])
def test_zero_key_attention_equals_attention_on_the_real_keys(real):
    q, k, v, valid = padded_batch(real, width=32, gen_len=40)
    want = exact(q, k, v, valid)
    got = ZeroKeyAttention(valid, backend="math")(q, k, v, causal=False)
    masked = KeyMaskAttention(valid, backend="math")(q, k, v, causal=False)
    assert rel(got, want) <= FP32_TOL and rel(masked, want) <= FP32_TOL


@pytest.mark.parametrize("backend", ["math", "auto"])  # auto on CPU: PyTorch's CPU flash kernel
def test_lse_is_the_natural_log_of_the_softmax_denominator(backend):
    q, k, v, _ = padded_batch([8], width=8, gen_len=16)
    k = k.repeat_interleave(2, dim=1)
    v = v.repeat_interleave(2, dim=1)
    out, lse = sdpa_with_lse(q, k, v, backend=backend)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5)
    assert rel(out, torch.softmax(scores, -1) @ v) <= FP32_TOL
    assert lse.shape == q.shape[:3]


def test_rescale_handles_large_logits_and_is_a_no_op_without_padding():
    """Large scores (lse >> log n) leave the padding's share negligible; zero padding changes nothing."""
    q, k, v, valid = padded_batch([3, 20], width=20, gen_len=10, logit_scale=8.0)
    want = exact(q, k, v, valid)
    assert rel(ZeroKeyAttention(valid, backend="math")(q, k, v, causal=False), want) <= FP32_TOL
    out = torch.randn(2, 3, 5, 4)
    assert torch.equal(rescale_zero_keys(out, torch.randn(2, 3, 5), torch.zeros(2)), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_zero_key_attention_on_gpu_kernels_matches_the_masked_kernel(backend):
    """bf16 on the GPU: the backend's own log-sum-exp (shape, natural log) must give the exact function."""
    torch.manual_seed(0)
    real, width, gen_len = [125, 30], 128, 3092
    q, k, v, valid = padded_batch(real, width=width, gen_len=gen_len, heads=16, kv_heads=16, d=128, queries=gen_len)
    q, k, v, valid = (t.cuda() for t in (q, k, v, valid))
    want = exact(q.float(), k.float(), v.float(), valid)
    got = ZeroKeyAttention(valid, backend=backend)(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=False)
    assert rel(got.float(), want) <= 1e-2  # bf16 operands
    from wamrt.ops.attention import zero_key_attention_problem

    assert zero_key_attention_problem(torch.device("cuda"), torch.bfloat16, backend) is None  # no fallback


def test_the_probe_accepts_the_cpu_path_and_reports_a_broken_kernel(monkeypatch):
    from wamrt.ops import attention

    assert attention.zero_key_attention_problem(torch.device("cpu"), torch.float32, "auto") is None

    def log2_lse(q, k, v, *, backend):  # another log-sum-exp convention must be caught, not served
        out, lse = sdpa_with_lse(q, k, v, backend="math")
        return out, lse / torch.log(torch.tensor(2.0))

    monkeypatch.setattr(attention, "sdpa_with_lse", log2_lse)
    assert "relative error" in attention.zero_key_attention_problem(torch.device("cpu"), torch.float32, "auto")
