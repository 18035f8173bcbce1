"""Attention backends for the two call sites of a Cosmos 3 step.

* Generator (rectangular, no mask): queries of one sequence against [its Reasoner prefix ; its
  Generator tokens]. Batched CFG packs sequences whose prefixes differ in length; rather than masks
  (which rule out the fastest kernels) the engine lays prefixes out left-padded and gives each
  sequence its own unmasked call on the valid suffix of the keys (a view, no copy).
* Reasoner (causal, short): any kernel; it runs once per prompt.

Backends are PyTorch SDPA kernels chosen explicitly, or "fa4": FlashAttention-4 (`flash-attn-4`, CuTe DSL,
Hopper / Blackwell kernels), an optional dependency used only where it is installed and chosen; masked and causal
calls stay on SDPA. "gqa" reproduces diffusers' call (SDPA with enable_gqa=True, which PyTorch serves with the
math kernel on CUDA) and is the E0 baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .capture_turn import capture_turn, graph_capture

BACKENDS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
    "auto": None,
    "fa4": [SDPBackend.CUDNN_ATTENTION],  # what SDPA serves for fa4 where FA4 itself does not run (masks)
}


def fa4_available(device: torch.device | None = None) -> bool:
    """flash-attn-4 importable and the GPU one of its architectures (sm90 Hopper, sm100 Blackwell)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False,
                  seqused_k: torch.Tensor | None = None):
    """Unmasked, non-causal FlashAttention-4 on [B, H, S, d] tensors (K/V may have fewer heads: GQA in the kernel).
    The kernel's [B, S, H, d] layout is a transposed view of ours, so nothing is copied either way; the output
    is a [B, H, Sq, d] view of [B, Sq, H, d] memory, the order the output projection reads. With return_lse also
    the log-sum-exp [B, H, Sq] fp32, natural log, as sdpa_with_lse returns it. seqused_k [B] int32: sequence b
    attends to its first seqused_k[b] keys only (the kernel's own lengths, read on the device); the keys after
    them must be finite (a tile that straddles the end is loaded whole, and masked scores times NaN are NaN)."""
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func  # optional: flash-attn-4

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if seqused_k is None:
        out, lse = flash_attn_func(qt, kt, vt, causal=False, return_lse=return_lse)
    else:
        out, lse = flash_attn_varlen_func(qt, kt, vt, seqused_k=seqused_k, causal=False, return_lse=return_lse)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, backend: str) -> torch.Tensor:
    """q [B, H, Sq, d], k/v [B, K, Sk, d]; K/V heads expanded so every backend is eligible."""
    if backend == "fa4":
        if not causal:
            return fa4_attention(q, k, v)
        backend = "auto"  # the Reasoner's causal prefill runs once per prompt: any kernel
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    kernels = BACKENDS[backend]
    if kernels is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel(kernels):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def diffusers_gqa_attention(q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What the reference does: SDPA with enable_gqa=True (math kernel on CUDA for GQA)."""
    if key_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :], enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


class BackendAttention:
    """The model's attention contract on a chosen SDPA backend (masked calls fall back to 'efficient')."""

    def __init__(self, generator: str = "cudnn", reasoner: str = "auto") -> None:
        self.generator, self.reasoner = generator, reasoner

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if key_mask is not None:
            groups = q.shape[1] // k.shape[1]
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups),
                                                      attn_mask=key_mask[:, None, None, :])
        return sdpa(q, k, v, causal=causal, backend=self.reasoner if causal else self.generator)


class PrefixOffsetAttention:
    """Generator attention for a batch whose Reasoner prefixes are left-padded to a common length.

    offsets[b] = number of padding keys at the front of sequence b; each sequence attends (unmasked)
    to keys[b, :, offsets[b]:], so every call is a plain rectangular kernel.
    """

    def __init__(self, offsets: Sequence[int], backend: str = "cudnn", reasoner: str = "auto") -> None:
        self.offsets = list(offsets)
        self.backend, self.reasoner = backend, reasoner

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if causal:
            return sdpa(q, k, v, causal=True, backend=self.reasoner)
        if all(o == 0 for o in self.offsets):
            return sdpa(q, k, v, causal=False, backend=self.backend)
        # Gather the per-sequence outputs in [B, Sq, H, d] memory order (the kernels' own layout), so the
        # one copy the gather costs also leaves the output projection's input contiguous.
        outs = [sdpa(q[b : b + 1], k[b : b + 1, :, o:], v[b : b + 1, :, o:], causal=False,
                     backend=self.backend).transpose(1, 2) for b, o in enumerate(self.offsets)]
        return torch.cat(outs, dim=0).transpose(1, 2)  # [B, H, Sq, d] view


class KeyLengthAttention:
    """Generator attention for a batch whose keys are laid out [Generator | Reasoner prefix | padding]: sequence b
    attends to its first lengths[b] keys (attention is a sum over keys: their order does not change it).

    On "fa4" the whole batch is one call, the lengths read by the kernel from the device (flash-attn-4's
    seqused_k): no per-sequence calls and no gather of their outputs, and twice the work items per launch. Other
    backends run PrefixOffsetAttention's per-sequence calls on this layout. The padding keys must be finite
    (the engine writes zeros there)."""

    def __init__(self, lengths: Sequence[int], device: torch.device, backend: str = "fa4",
                 reasoner: str = "auto") -> None:
        self.lengths = list(lengths)
        self.backend, self.reasoner = backend, reasoner
        # Device fills from Python ints (no host-to-device copy), so it can be made inside graph capture.
        self.used = (torch.stack([torch.full((), n, dtype=torch.int32, device=device) for n in self.lengths])
                     if backend == "fa4" else None)

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if causal:
            return sdpa(q, k, v, causal=True, backend=self.reasoner)
        if all(n == k.shape[2] for n in self.lengths):
            return sdpa(q, k, v, causal=False, backend=self.backend)
        if self.used is not None:
            return fa4_attention(q, k, v, seqused_k=self.used)
        # [B, Sq, H, d] memory order, as PrefixOffsetAttention's gather.
        outs = [sdpa(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=False,
                     backend=self.backend).transpose(1, 2) for b, n in enumerate(self.lengths)]
        return torch.cat(outs, dim=0).transpose(1, 2)


class KeyMaskAttention:
    """Generator attention over padded keys whose validity is a tensor (valid [B, Sk], True = attend): one
    masked call for the whole batch. The mask is data, not Python ints, so one captured CUDA graph serves
    every prefix length that fits the padded width (the engine's prompt buckets)."""

    def __init__(self, valid: torch.Tensor, backend: str = "cudnn", reasoner: str = "auto") -> None:
        self.mask = valid[:, None, None, :]  # [B, 1, 1, Sk]
        self.backend, self.reasoner = backend, reasoner

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if causal:
            return sdpa(q, k, v, causal=True, backend=self.reasoner)
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        kernels = BACKENDS[self.backend]
        if kernels is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        with sdpa_kernel(kernels + [SDPBackend.EFFICIENT_ATTENTION]):  # in case cuDNN refuses the mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked, non-causal attention and its log-sum-exp: (out [B, H, Sq, d], lse [B, H, Sq] fp32, natural log of
    the sum over keys of exp(scale * q.k)). K/V heads must already match q's. The SDPA front end drops the
    log-sum-exp at inference, so this calls the backend's own op; "math" / CPU-only cases compute it directly."""
    b, h, sq, _ = q.shape
    if q.is_cuda and backend == "fa4":
        out, lse = fa4_attention(q, k, v, return_lse=True)
    elif q.is_cuda and backend in ("cudnn", "auto"):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)[:2]
    elif q.is_cuda and backend == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[:2]
    elif q.is_cuda and backend == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False)[:2]
    elif not q.is_cuda and backend != "math":
        # PyTorch's CPU flash kernel returns the log-sum-exp too: the CPU engine tests' bucketed graphs (3,000+
        # Generator tokens) ran the explicit form below at ~5 s per step, this at ~10 ms.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(scores, dim=-1)
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    # cuDNN returns [B, H, Sq, 1]; the efficient kernel pads Sq to a multiple of 32.
    return out, lse.reshape(b, h, -1)[..., :sq]


def rescale_zero_keys(out: torch.Tensor, lse: torch.Tensor, zero_keys: torch.Tensor) -> torch.Tensor:
    """Attention over real keys from attention over real + all-zero keys (zero values too): a zero key scores
    exactly 0, so it adds exp(0) = 1 to the softmax denominator and nothing to the numerator. With
    Z = exp(lse) the padded denominator, out_real = out * Z / (Z - n) = out / (1 - n * exp(-lse)).
    zero_keys [B] (float): padding keys per sequence. Well conditioned while the real keys' mass exp(lse) - n
    is not far below n: at Edge / Nano a prefix pads <= bucket - 1 keys among 3,000+ real ones."""
    factor = 1.0 / (1.0 - zero_keys[:, None, None] * torch.exp(-lse))
    return (out.float() * factor[..., None]).to(out.dtype)


def zero_key_attention_problem(device: torch.device, dtype: torch.dtype, backend: str) -> str | None:
    """None if ZeroKeyAttention on this device / dtype / backend matches the masked kernel on a small probe; else
    what went wrong (an op this torch build lacks, another log-sum-exp convention), so a caller can fall back."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, h, sq, sk, d, pad = 2, 2, 48, 80, 64, 16
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for n in (sq, sk, sk))
    valid = torch.ones(b, sk, dtype=torch.bool, device=device)
    valid[1, :pad] = False
    k[1, :, :pad] = 0
    v[1, :, :pad] = 0
    try:
        got = ZeroKeyAttention(valid, backend=backend)(q, k, v, causal=False).float()
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=valid[:, None, None, :])
    err = float((got - want).norm() / want.norm())
    return None if err <= (1e-2 if dtype != torch.float32 else 1e-4) else f"relative error {err:.2e} vs the mask"


class ZeroKeyAttention:
    """Generator attention over prefixes padded with all-zero keys and values (the engine's prompt buckets):
    one unmasked call for the whole batch on the fastest kernel, then each output row rescaled by its
    log-sum-exp (`rescale_zero_keys`) to remove the padding's share. The padding count is computed from the
    validity tensor on the device, so one captured CUDA graph serves every prefix length in the bucket.
    Replaces the masked kernel of KeyMaskAttention: H200, 4-step requests end to end, Edge 180.1 vs 227.8 ms and
    Nano 679.9 vs 788.7 ms, and no slower than exact prompt lengths (183.0 / 683.5 ms; bench/results/latency/)."""

    def __init__(self, valid: torch.Tensor, backend: str = "cudnn", reasoner: str = "auto", rescale=None) -> None:
        self.zero_keys = (~valid).sum(dim=1, dtype=torch.float32)  # [B]
        self.backend, self.reasoner = backend, reasoner
        self.rescale = rescale or rescale_zero_keys

    def __call__(self, q, k, v, *, causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if causal:
            return sdpa(q, k, v, causal=True, backend=self.reasoner)
        groups = q.shape[1] // k.shape[1]
        out, lse = sdpa_with_lse(q, _expand_kv(k, groups), _expand_kv(v, groups), backend=self.backend)
        return self.rescale(out, lse, self.zero_keys)


class MaskedBatchAttention(KeyMaskAttention):
    """The alternative to PrefixOffsetAttention: one call for the whole batch, padding keys masked out
    (valid[b, j] = j >= offsets[b]). Fewer, larger kernel calls, but a masked kernel."""

    def __init__(self, offsets: Sequence[int], key_len: int, device: torch.device, backend: str = "cudnn",
                 reasoner: str = "auto") -> None:
        self.offsets = list(offsets)
        pos = torch.arange(key_len, device=device)
        # Built from Python ints (no host-to-device copy), so it can be made inside graph capture.
        super().__init__(torch.stack([pos >= o for o in self.offsets]), backend, reasoner)


def measure_backends(q_shape: tuple[int, int, int, int], kv_heads: int, kv_len: int, *, dtype: torch.dtype,
                     device: torch.device, backends: Sequence[str] | None = None,
                     iters: int = 10) -> dict[str, float]:
    """Median device ms of one rectangular Generator attention call per backend (inf where unsupported). Default
    backends: cuDNN, flash, efficient, and fa4 where flash-attn-4 is installed.

    Timed as the engine runs them, `iters` calls captured in one CUDA graph: no host launch cost. Timed one eager call
    at a time, flash-attn-4's Python launch (~0.1-0.2 ms) counted, and the probe picked cuDNN for Edge on some leases
    (H200, 2026-12-03: 0.40 vs 0.48 ms) while fa4 took 0.26 ms per call inside the engine's graph."""
    if backends is None:
        backends = ("cudnn", "flash", "efficient") + (("fa4",) if fa4_available(device) else ())
    b, h, sq, d = q_shape
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(q_shape, device=device, dtype=dtype, generator=gen)
    k = torch.randn((b, kv_heads, kv_len, d), device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    out: dict[str, float] = {}
    for name in backends:
        try:
            out[name] = _graph_ms(lambda name=name: sdpa(q, k, v, causal=False, backend=name), iters)
        except (RuntimeError, ImportError, AssertionError, ValueError) as e:  # a kernel that refuses the shape
            out[name] = float("inf")
            if name == "fa4":
                import logging

                logging.getLogger(__name__).warning("fa4 attention unavailable at %s: %s", q_shape, e)
    return out


def _graph_ms(fn: Callable[[], Any], iters: int, replays: int = 7) -> float:
    """Median device ms per call of `fn` captured `iters` times in one CUDA graph (warmed up on a side stream)."""
    with capture_turn():  # a backend's first runs compile and autotune: not while another thread captures
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            for _ in range(iters):
                fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    del graph
    return sorted(times)[len(times) // 2]
