"""Attention of one new token per sequence over its row of the K/V cache, split over the keys (flash-decoding), the
token's own K/V written into the cache by the same kernel: the Reasoner's text decode step (`reasoner.lm`).

Why a kernel of our own: in a batch-1 Nano decode step on the H100 (bench/results/decode/2026-12-06-0230412-nano-h100/)
cuDNN's flash forward took 18.8 us a layer for one query row over ~600 keys. The 8 K/V heads give it 8 blocks on
132 SMs, so it runs at a fraction of the memory bandwidth on ~2.5 MB. The cache write added two `index_put` kernels a
layer (3.5 us each), and SDPA's mask conversion a fill and an elementwise kernel. Together that is ~1.1 ms of a 7.5 ms
step, where the step's floor is its weight reads. Here one program per (sequence, K/V head, BLOCK_N keys) computes a
split's softmax-weighted sum and its log-sum-exp. At a span of 640 that is 8 x 10 programs instead of 8. The
program whose split holds the new token's position takes its K/V from the projection and stores them in the cache.
A second kernel merges the splits by their log-sum-exp.

The query heads of one K/V head (GQA, 4 at Nano) share that head's keys: they are the rows of one `tl.dot`, padded to
16. Keys past `index[b]` are not read. Scores, softmax and accumulation are fp32; the probabilities are rounded to the
cache's dtype before the PV product, as flash kernels do. `decode_attention_reference` is the same computation in
PyTorch (SDPA over the masked span), and runs where Triton cannot (CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_support import triton_device_problem

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64  # keys per split program
MIN_ROWS = 16  # tl.dot's smallest M: the query heads of a K/V head are padded to it


def decode_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, index: torch.Tensor, span: int) -> torch.Tensor:
    """q [B, H, 1, d]; k_new, v_new [B, K, 1, d]: the step's token; keys, values [B_max, K, S, d]: one layer's cache,
    written in place at position index[b] of row b (index [B] long); the query of row b attends to the row's first
    `span` positions up to index[b]. -> [B, H, 1, d]."""
    b, h, _, d = q.shape
    kv_heads = k_new.shape[1]
    rows = torch.arange(b, device=q.device)
    keys[rows, :, index] = k_new[:, :, 0]
    values[rows, :, index] = v_new[:, :, 0]
    return sdpa_over_cache(q, keys, values, additive_mask(index, span, q.dtype), kv_heads)


def additive_mask(index: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, span]: 0 at the positions a row attends to (up to index[b]), -inf after."""
    allowed = torch.arange(span, device=index.device)[None] <= index[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=index.device).masked_fill_(~allowed, float("-inf"))[
        :, None, None, :]


def sdpa_over_cache(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    kv_heads: int) -> torch.Tensor:
    """SDPA of q [B, H, 1, d] over the cache's first `mask.shape[-1]` positions. The query heads of one K/V head share
    its keys: they attend as [B, K, group, d] rather than repeating the cache (which would copy the whole cached span
    once per layer)."""
    b, h, _, d = q.shape
    span = mask.shape[-1]
    o = F.scaled_dot_product_attention(q.reshape(b, kv_heads, h // kv_heads, d), keys[:b, :, :span],
                                       values[:b, :, :span], attn_mask=mask)
    return o.reshape(b, h, 1, d)


def decode_attention_problem(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take these tensors, or None."""
    problem = triton_device_problem(q.device)
    if problem:
        return problem
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head size {d}: the kernel takes powers of two from 16"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype}: the kernel takes bf16 or fp16 (its products run on 16-bit tensor cores)"
    if keys.stride(-1) != 1 or q.dtype != keys.dtype:
        return "the cache must be dense in the head dimension and in the query's dtype"
    if values is not None and (values.stride() != keys.stride() or values.dtype != keys.dtype):
        return "keys and values must share one layout (the kernel reads both through the keys' strides)"
    return None


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, index: torch.Tensor, span: int) -> torch.Tensor:
    """`decode_attention_reference` (same arguments, same cache write) in two Triton kernels; the reference where
    they cannot run (`decode_attention_problem`)."""
    if decode_attention_problem(q, keys, values):
        return decode_attention_reference(q, k_new, v_new, keys, values, index, span)
    b, h, _, d = q.shape
    kv_heads = k_new.shape[1]
    group = h // kv_heads
    # [B, H, d] and [B, K, d] views, read through their strides: no copy a layer unless the head dim is strided
    q3, kn, vn = (x[:, :, 0] if x.stride(-1) == 1 else x[:, :, 0].contiguous() for x in (q, k_new, v_new))
    splits = triton.cdiv(span, BLOCK_N)
    part = torch.empty((b, kv_heads, splits, group, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, kv_heads, splits, group), dtype=torch.float32, device=q.device)
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    _split_kernel[(b, kv_heads, splits)](
        q3, kn, vn, keys, values, index, part, lse,
        q3.stride(0), q3.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        d ** -0.5, GROUP=group, ROWS=rows, D=d, BLOCK=BLOCK_N, num_warps=4)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    _merge_kernel[(b, h)](part, lse, out, splits, GROUP=group, D=d, SPLITS=triton.next_power_of_2(splits),
                          num_warps=4)
    return out[:, :, None]


if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, idx_ptr, part_ptr, lse_ptr,
                      sq_b, sq_h, sn_b, sn_h, sv_b, sv_h, sk_b, sk_h, sk_s, scale,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        splits = tl.num_programs(2)
        idx = tl.load(idx_ptr + b)  # the new token's position: keys 0..idx are attended
        g = tl.arange(0, ROWS)
        dd = tl.arange(0, D)
        n = sp * BLOCK + tl.arange(0, BLOCK)
        q = tl.load(q_ptr + b * sq_b + (kh * GROUP + g)[:, None] * sq_h + dd[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        cache = b.to(tl.int64) * sk_b + kh * sk_h
        kn = tl.load(kn_ptr + b * sn_b + kh * sn_h + dd)
        vn = tl.load(vn_ptr + b * sv_b + kh * sv_h + dd)
        old = (n < idx)[:, None]  # positions before the new token come from the cache
        k = tl.load(k_ptr + cache + n[:, None].to(tl.int64) * sk_s + dd[None, :], mask=old, other=0.0)
        v = tl.load(v_ptr + cache + n[:, None].to(tl.int64) * sk_s + dd[None, :], mask=old, other=0.0)
        is_new = (n == idx)[:, None]
        k = tl.where(is_new, kn[None, :], k)
        v = tl.where(is_new, vn[None, :], v)
        if (idx >= sp * BLOCK) & (idx < sp * BLOCK + BLOCK):  # this split holds the new token: write it to the cache
            tl.store(k_ptr + cache + idx.to(tl.int64) * sk_s + dd, kn)
            tl.store(v_ptr + cache + idx.to(tl.int64) * sk_s + dd, vn)
        s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK] fp32
        s = tl.where((n <= idx)[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a split wholly past the new token: nothing to weigh
        p = tl.exp(s - m_safe[:, None])
        total = tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v)  # [ROWS, D] fp32
        o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total))
        row = ((b * tl.num_programs(1) + kh) * splits + sp) * GROUP + g  # [B, K, splits, GROUP] row-major
        keep = g < GROUP
        tl.store(part_ptr + row[:, None].to(tl.int64) * D + dd[None, :], o, mask=keep[:, None])
        tl.store(lse_ptr + row, lse, mask=keep)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits, GROUP: tl.constexpr, D: tl.constexpr,
                      SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        kh = h // GROUP
        g = h % GROUP
        s = tl.arange(0, SPLITS)
        dd = tl.arange(0, D)
        kv_heads = heads // GROUP
        row = ((b * kv_heads + kh) * splits + s) * GROUP + g  # [SPLITS]
        live = s < splits
        lse = tl.load(lse_ptr + row, mask=live, other=float("-inf"))
        top = tl.max(lse, axis=0)  # split 0 always holds position 0: finite
        w = tl.exp(lse - top)
        part = tl.load(part_ptr + row[:, None].to(tl.int64) * D + dd[None, :], mask=live[:, None], other=0.0)
        o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + (b * heads + h).to(tl.int64) * D + dd, o.to(out_ptr.dtype.element_ty))
