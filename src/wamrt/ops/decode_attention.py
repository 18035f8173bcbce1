"""Attention of one new token per sequence over its row of the K/V cache, split over the keys (flash-decoding), the
token's own K/V written into the cache by the same kernel: the Reasoner's text decode step (`reasoner.lm`).

Why a kernel of our own: in a batch-1 Nano decode step on the H100 (bench/results/decode/2026-12-06-0230412-nano-h100/)
cuDNN's flash forward took 18.8 us a layer for one query row over ~600 keys. The 8 K/V heads give it 8 blocks on
132 SMs, so it runs at a fraction of the memory bandwidth on ~2.5 MB. The cache write added two `index_put` kernels a
layer (3.5 us each), and SDPA's mask conversion a fill and an elementwise kernel. Together that is ~1.1 ms of a 7.5 ms
step, where the step's floor is its weight reads. Here one program per (sequence, K/V head, BLOCK_N keys) computes a
split's softmax-weighted sum and its log-sum-exp. At a span of 640 that is 8 x 10 programs instead of 8. The
program whose split holds the new token's position takes its K/V from the projection and stores them in the cache.
The splits are merged by their log-sum-exp: given an `arrivals` counter ([B, K] int32, zero, e.g. `KVCache.arrivals`)
by the last split program of each K/V head to finish (it counts the arrivals atomically, merges that head's query
heads and sets the counter back to zero), otherwise by a second kernel. At one row that second kernel was 36 of a
Nano step's 251 kernels: 61 us and their launch gaps
(bench/results/decode/2026-12-06-1f62247-nano-h100-one-row-folded/).

The query heads of one K/V head (GQA, 4 at Nano) share that head's keys: they are the rows of one `tl.dot`, padded to
16. Keys past `index[b]` are not read. Scores, softmax and accumulation are fp32; the probabilities are rounded to the
cache's dtype before the PV product, as flash kernels do. `decode_attention_reference` is the same computation in
PyTorch (SDPA over the masked span), and runs where Triton cannot (CPU).

`decode_attention_from_projections` takes the q/k/v projections before the per-head q/k RMSNorms and RoPE and applies
them as the split kernel loads the query and the new key (each program for its own query heads; the key it writes
to the cache is the normed, rotated one). At one row that is two fewer kernels a layer: the compiled norm + RoPE
region took 0.12 ms of a 5.9 ms Nano step on the H100 (bench/results/decode/2026-12-06-945d6c9-nano-h100-one-row/).
Triton's CPU interpreter runs these kernels in fp16 (its bf16 `tl.dot` is wrong), which is how they were checked
before a GPU ran them.

`pdl=True` launches the split kernel with programmatic dependent launch (`triton_support.pdl_problem`): it may start
while the kernel before it (the q/k/v GEMV) still runs, reads the cached keys and values of earlier positions, which
no kernel of this step writes, and waits for that kernel before it reads the projections.
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
try:  # grid-dependency control (PDL); not in every Triton, and never traced unless `pdl=True`
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    gdc_launch_dependents = gdc_wait = None

BLOCK_N = 64  # keys per split program
MIN_ROWS = 16  # tl.dot's smallest M: the query heads of a K/V head are padded to it
MERGE_SPLITS = 16  # splits the last program merges per pass (longer spans take several passes)


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
                     values: torch.Tensor, index: torch.Tensor, span: int, arrivals: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`decode_attention_reference` (same arguments, same cache write) in Triton: the split kernel, merged by its last
    programs when `arrivals` ([B_max, K] int32, all zero between calls) is given, else by a second kernel; the
    reference where they cannot run (`decode_attention_problem`)."""
    if decode_attention_problem(q, keys, values):
        return decode_attention_reference(q, k_new, v_new, keys, values, index, span)
    # [B, H, d] and [B, K, d] views, read through their strides: no copy a layer unless the head dim is strided
    q3, kn, vn = (x[:, :, 0] if x.stride(-1) == 1 else x[:, :, 0].contiguous() for x in (q, k_new, v_new))
    return _launch(q3, kn, vn, keys, values, index, span, arrivals=arrivals)


def decode_attention_from_projections(qkv: torch.Tensor, heads: int, kv_heads: int, norm_q: torch.nn.Module | None,
                                      norm_k: torch.nn.Module | None, cos: torch.Tensor, sin: torch.Tensor,
                                      keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, span: int,
                                      arrivals: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`decode_attention` of the step's q/k/v projections before their per-head RMSNorms (`norm_q` / `norm_k`, or
    None) and rotary embedding (`cos` / `sin` [B, 1, d], rotate-half): qkv [B, 1, (H + 2K) d] -> [B, H, 1, d]. The
    split kernel applies the norms and RoPE to the query and the new key as it loads them (in fp32, rounded once), so
    they are no kernels of their own; the key it writes to the cache is the normed, rotated one. `arrivals` and
    `pdl` as in the module docstring. Only where `decode_attention_from_projections_problem` is None (and
    `triton_support.pdl_problem` for `pdl`)."""
    b, d = qkv.shape[0], keys.shape[-1]
    flat = qkv.reshape(b, (heads + 2 * kv_heads) * d)
    q3 = flat[:, :heads * d].unflatten(1, (heads, d))
    kn = flat[:, heads * d:(heads + kv_heads) * d].unflatten(1, (kv_heads, d))
    vn = flat[:, (heads + kv_heads) * d:].unflatten(1, (kv_heads, d))
    has_norm = norm_q is not None
    return _launch(q3, kn, vn, keys, values, index, span, prep=(
        norm_q.weight if has_norm else cos, norm_k.weight if has_norm else cos, cos.reshape(b, d), sin.reshape(b, d),
        float(norm_q.eps) if has_norm else 0.0, float(norm_k.eps) if has_norm else 0.0, has_norm), arrivals=arrivals,
        pdl=pdl)


def decode_attention_from_projections_problem(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                              norm_q: torch.nn.Module | None, norm_k: torch.nn.Module | None,
                                              cos: torch.Tensor) -> str | None:
    """Why `decode_attention_from_projections` cannot take these, or None."""
    d = keys.shape[-1]
    problem = decode_attention_problem(qkv[..., :d], keys, values)
    if problem:
        return problem
    if not qkv.is_contiguous() or not cos.is_contiguous() or cos.shape[-1] != d or cos.dtype != qkv.dtype:
        return "the projections and the RoPE tables must be contiguous, in the cache's dtype"
    if (norm_q is None) != (norm_k is None) or any(
            n is not None and (n.weight.shape != (d,) or n.weight.dtype != qkv.dtype) for n in (norm_q, norm_k)):
        return "the q/k norms must both be RMSNorms over the head, in the cache's dtype (or both absent)"
    return None


def _launch(q3, kn, vn, keys, values, index, span, prep=None, arrivals=None, pdl=False):
    b, h, d = q3.shape
    kv_heads = kn.shape[1]
    group = h // kv_heads
    splits = triton.cdiv(span, BLOCK_N)
    part = torch.empty((b, kv_heads, splits, group, d), dtype=torch.float32, device=q3.device)
    lse = torch.empty((b, kv_heads, splits, group), dtype=torch.float32, device=q3.device)
    out = torch.empty((b, h, d), dtype=keys.dtype, device=q3.device)
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    norm_q, norm_k, cos, sin, eps_q, eps_k, has_norm = prep or (q3, q3, q3, q3, 0.0, 0.0, False)
    merge = arrivals is not None
    if merge and (arrivals.dtype != torch.int32 or not arrivals.is_contiguous() or arrivals.shape[0] < b
                  or arrivals.shape[1] != kv_heads):
        raise ValueError(f"arrivals: a contiguous int32 [>= {b}, {kv_heads}] counter, got "
                         f"{arrivals.dtype} {list(arrivals.shape)}")
    _split_kernel[(b, kv_heads, splits)](
        q3, kn, vn, keys, values, index, part, lse, norm_q, norm_k, cos, sin, arrivals if merge else index, out, splits,
        q3.stride(0), q3.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), cos.stride(0),
        d ** -0.5, eps_q, eps_k, GROUP=group, ROWS=rows, D=d, BLOCK=BLOCK_N, PREP=prep is not None,
        HAS_NORM=has_norm, MERGE=merge, MERGE_SPLITS=MERGE_SPLITS, MERGE_PASSES=triton.cdiv(splits, MERGE_SPLITS),
        GROUP_P2=triton.next_power_of_2(group), PDL=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}))
    if not merge:
        _merge_kernel[(b, h)](part, lse, out, splits, GROUP=group, D=d, SPLITS=triton.next_power_of_2(splits),
                              PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out[:, :, None]


if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, idx_ptr, part_ptr, lse_ptr, nq_ptr, nk_ptr, cos_ptr,
                      sin_ptr, arrivals_ptr, out_ptr, splits, sq_b, sq_h, sn_b, sn_h, sv_b, sv_h, sk_b, sk_h, sk_s,
                      sc_b, scale, eps_q, eps_k, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                      BLOCK: tl.constexpr, PREP: tl.constexpr, HAS_NORM: tl.constexpr, MERGE: tl.constexpr,
                      MERGE_SPLITS: tl.constexpr, MERGE_PASSES: tl.constexpr, GROUP_P2: tl.constexpr,
                      PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)  # of `splits`
        idx = tl.load(idx_ptr + b)  # the new token's position: keys 0..idx are attended
        g = tl.arange(0, ROWS)
        dd = tl.arange(0, D)
        n = sp * BLOCK + tl.arange(0, BLOCK)
        cache = b.to(tl.int64) * sk_b + kh * sk_h
        # positions before the new token come from the cache, which no kernel of this step writes: read before the wait
        old = (n < idx)[:, None]
        k = tl.load(k_ptr + cache + n[:, None].to(tl.int64) * sk_s + dd[None, :], mask=old, other=0.0)
        v = tl.load(v_ptr + cache + n[:, None].to(tl.int64) * sk_s + dd[None, :], mask=old, other=0.0)
        if PDL:  # the projections are the previous kernel's output
            gdc_wait()
        q_rows = q_ptr + b * sq_b + (kh * GROUP + g)[:, None] * sq_h
        q = tl.load(q_rows + dd[None, :], mask=(g < GROUP)[:, None], other=0.0)
        kn = tl.load(kn_ptr + b * sn_b + kh * sn_h + dd)
        vn = tl.load(vn_ptr + b * sv_b + kh * sv_h + dd)
        if PREP:  # q and the new k are raw projections: per-head RMSNorm, then RoPE (rotate-half), in fp32
            half = (dd + D // 2) % D  # rotate_half(x)[i] = -x[i + D/2] below D/2, x[i - D/2] above
            sign = tl.where(dd < D // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + b * sc_b + dd).to(tl.float32)
            sin = tl.load(sin_ptr + b * sc_b + dd).to(tl.float32) * sign
            qf = q.to(tl.float32)
            q_half = tl.load(q_rows + half[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
            kf = kn.to(tl.float32)
            k_half = tl.load(kn_ptr + b * sn_b + kh * sn_h + half).to(tl.float32)
            if HAS_NORM:
                q_scale = tl.rsqrt(tl.sum(qf * qf, axis=1) / D + eps_q)[:, None]
                qf = qf * q_scale * tl.load(nq_ptr + dd).to(tl.float32)[None, :]
                q_half = q_half * q_scale * tl.load(nq_ptr + half).to(tl.float32)[None, :]
                k_scale = tl.rsqrt(tl.sum(kf * kf, axis=0) / D + eps_k)
                kf = kf * k_scale * tl.load(nk_ptr + dd).to(tl.float32)
                k_half = k_half * k_scale * tl.load(nk_ptr + half).to(tl.float32)
            q = (qf * cos[None, :] + q_half * sin[None, :]).to(k_ptr.dtype.element_ty)
            kn = (kf * cos + k_half * sin).to(k_ptr.dtype.element_ty)
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
        kv_heads = tl.num_programs(1)
        head_rows = (b * kv_heads + kh) * splits  # this K/V head's first row of [B, K, splits, GROUP] (row-major)
        row = (head_rows + sp) * GROUP + g
        keep = g < GROUP
        tl.store(part_ptr + row[:, None].to(tl.int64) * D + dd[None, :], o, mask=keep[:, None])
        tl.store(lse_ptr + row, lse, mask=keep)
        if MERGE:
            # Every thread's stores above, then one release-acquire increment for the program: the program that
            # counts the last arrival sees every split's part and lse (read past L1, which may hold stale lines).
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + b * kv_heads + kh, 1, sem="acq_rel")
            if arrived == splits - 1:
                gi = tl.arange(0, GROUP_P2)
                si = tl.arange(0, MERGE_SPLITS)
                top = tl.full((GROUP_P2,), float("-inf"), tl.float32)
                num = tl.zeros((GROUP_P2, D), dtype=tl.float32)
                den = tl.zeros((GROUP_P2,), dtype=tl.float32)
                for i in range(MERGE_PASSES):  # online log-sum-exp: split 0 (position 0) is finite
                    s0 = i * MERGE_SPLITS
                    live = ((s0 + si) < splits)[:, None] & (gi < GROUP)[None, :]
                    merge_rows = (head_rows + s0 + si)[:, None] * GROUP + gi[None, :]  # [MERGE_SPLITS, GROUP_P2]
                    part_lse = tl.load(lse_ptr + merge_rows, mask=live, other=float("-inf"), cache_modifier=".cg")
                    parts = tl.load(part_ptr + merge_rows[:, :, None].to(tl.int64) * D + dd[None, None, :],
                                    mask=live[:, :, None], other=0.0, cache_modifier=".cg")
                    new_top = tl.maximum(top, tl.max(part_lse, axis=0))
                    new_top = tl.where(new_top == float("-inf"), 0.0, new_top)  # padded query heads only
                    rescale = tl.exp(top - new_top)
                    w = tl.exp(part_lse - new_top[None, :])
                    num = num * rescale[:, None] + tl.sum(w[:, :, None] * parts, axis=0)
                    den = den * rescale + tl.sum(w, axis=0)
                    top = new_top
                heads = kv_heads * GROUP
                o_rows = (b * heads + kh * GROUP + gi).to(tl.int64)
                merged = num / tl.where(den == 0.0, 1.0, den)[:, None]
                tl.store(out_ptr + o_rows[:, None] * D + dd[None, :], merged.to(out_ptr.dtype.element_ty),
                         mask=(gi < GROUP)[:, None])
                tl.atomic_xchg(arrivals_ptr + b * kv_heads + kh, 0)  # ready for the next call

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits, GROUP: tl.constexpr, D: tl.constexpr,
                      SPLITS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # nothing to read before the split kernel's output: the launch alone is what overlaps
            gdc_launch_dependents()
            gdc_wait()
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
