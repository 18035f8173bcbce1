"""The Generator's q/k/v epilogue as one Triton kernel: per-head RMSNorm and RoPE of q and k, and the stores of k
and v into the step K/V buffers (heads repeated for GQA where the buffers hold the query heads).

Compiled by Inductor, `MoTAttention.generator_heads` plus the two buffer stores were four kernels per layer and
step (H200, Edge E6 trace at dd746d7: 8.8 ms of the 113 ms denoise stage): a reduction kernel each for q and k,
and since a norm's output feeding a repeated (GQA) store lands in a kernel of its own, two more for the k and v
stores, k round-tripping through memory. The work is one memory pass -- read the projection once, write q and
the buffers once -- which is what this kernel does, one program per token row.

Numerics are Inductor's for the same code (what the "inductor" epilogue runs): fp32 throughout, rounded to the model
dtype where `RMSNorm` casts explicitly and at the stores; the eager model rounds after every bf16 tensor op as well.
The GPU test holds the kernel to the fp32 function: no further from it than eager bf16 is.
"""

from __future__ import annotations

import torch

from ..model.layer import MoTAttention
from ..model.norms import RMSNorm
from ..model.rope import Rope
from ..ops.fp8_gemm import TileConfig, fp8_gemm_problem
from ..ops.triton_support import triton_device_problem
from ..quant.fp8 import Fp8Linear

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernel
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..ops.fp8_gemm import _tile_origin
except ImportError:  # pragma: no cover - depends on the install
    triton = None

HEAD_EPILOGUES = ("inductor", "triton")


def generator_heads_into_reference(attn: MoTAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                                   kbuf: torch.Tensor, vbuf: torch.Tensor, start: int) -> torch.Tensor:
    """The model's `generator_heads` on the projections q [B, G, H*d], k, v [B, G, K*d], k and v then stored into
    kbuf / vbuf [B, KB, L, d] at positions [start, start + G) with each K/V head repeated KB / K times
    -> q [B, H, G, d]."""
    q, k, v = attn.generator_heads(q, k, v, rope)
    n = k.shape[2]
    kbuf[:, :, start : start + n] = repeat_heads(k, kbuf.shape[1])
    vbuf[:, :, start : start + n] = repeat_heads(v, vbuf.shape[1])
    return q


def repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, K, S, d] K or V with its heads repeated (GQA groups) up to `heads`."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


if triton is not None:

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _load_halves(ptrs, mask, D: tl.constexpr):
        """The first and second halves of each head's row at `ptrs` (pointers to the first halves), as fp32."""
        return (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32),
                tl.load(ptrs + D // 2, mask=mask, other=0.0).to(tl.float32))

    @triton.jit
    def _norm_rope(x1, x2, w_ptr, cos1, cos2, sin1, sin2, eps, D: tl.constexpr, NEMOTRON: tl.constexpr,
                   DTYPE: tl.constexpr):
        """[heads, D/2] halves of fp32 rows -> the halves after the per-head RMSNorm and rotate-half RoPE (fp32)."""
        half = tl.arange(0, D // 2)
        w1 = tl.load(w_ptr + half).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)[None, :]
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        if NEMOTRON:  # (w.float() * x.float() * inv).to(dtype)
            y1, y2 = _round(w1 * (x1 * inv), DTYPE), _round(w2 * (x2 * inv), DTYPE)
        else:  # (x * inv).to(dtype) * w
            y1, y2 = _round(x1 * inv, DTYPE) * w1, _round(x2 * inv, DTYPE) * w2
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        return y1 * cos1 - y2 * sin1, y2 * cos2 + y1 * sin2

    @triton.jit
    def _qkv_heads_kernel(q_src, k_src, v_src, q_row_stride, k_row_stride, v_row_stride, rope_cos, rope_sin,
                          rope_row_stride, wq_ptr, wk_ptr, q_out, k_buf, v_buf, buf_b_stride, buf_h_stride,
                          buf_t_stride, rows_per_seq, start, eps, H: tl.constexpr, KH: tl.constexpr,
                          REP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                          NEMOTRON: tl.constexpr):
        DTYPE = q_out.dtype.element_ty  # the model dtype, for the norm's explicit cast
        row = tl.program_id(0)
        b = row // rows_per_seq
        t = row % rows_per_seq
        half = tl.arange(0, D // 2)[None, :]
        cos1 = tl.load(rope_cos + row * rope_row_stride + half).to(tl.float32)
        cos2 = tl.load(rope_cos + row * rope_row_stride + D // 2 + half).to(tl.float32)
        sin1 = tl.load(rope_sin + row * rope_row_stride + half).to(tl.float32)
        sin2 = tl.load(rope_sin + row * rope_row_stride + D // 2 + half).to(tl.float32)

        hq = tl.arange(0, BLOCK_H)[:, None]
        mq = hq < H
        x1, x2 = _load_halves(q_src + row.to(tl.int64) * q_row_stride + hq * D + half, mq, D)
        y1, y2 = _norm_rope(x1, x2, wq_ptr, cos1, cos2, sin1, sin2, eps, D, NEMOTRON, DTYPE)
        dst = q_out + row.to(tl.int64) * (H * D) + hq * D + half
        tl.store(dst, y1, mask=mq)
        tl.store(dst + D // 2, y2, mask=mq)

        hk = tl.arange(0, BLOCK_KH)[:, None]
        mk = hk < KH
        x1, x2 = _load_halves(k_src + row.to(tl.int64) * k_row_stride + hk * D + half, mk, D)
        y1, y2 = _norm_rope(x1, x2, wk_ptr, cos1, cos2, sin1, sin2, eps, D, NEMOTRON, DTYPE)
        src = v_src + row.to(tl.int64) * v_row_stride + hk * D + half
        v1 = tl.load(src, mask=mk, other=0.0)
        v2 = tl.load(src + D // 2, mask=mk, other=0.0)
        pos = b.to(tl.int64) * buf_b_stride + (start + t).to(tl.int64) * buf_t_stride + half
        for j in tl.static_range(REP):  # the K/V head's copies for its query-head group (repeat_interleave)
            at = pos + (hk * REP + j) * buf_h_stride
            tl.store(k_buf + at, y1, mask=mk)
            tl.store(k_buf + at + D // 2, y2, mask=mk)
            tl.store(v_buf + at, v1, mask=mk)
            tl.store(v_buf + at + D // 2, v2, mask=mk)


_DTYPES = (torch.bfloat16, torch.float16)


def head_epilogue_problem(attn: MoTAttention, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `generator_heads_into` cannot serve this attention module here, or None."""
    problem = triton_device_problem(device)
    if problem:
        return problem
    if dtype not in _DTYPES:
        return f"the kernel runs bf16 / fp16 models, not {dtype}"
    d = attn.head_dim
    if d & (d - 1) or d < 4:
        return f"head_dim {d} is not a power of two"
    for name in ("norm_added_q", "norm_added_k"):
        norm = getattr(attn, name)
        if type(norm) is not RMSNorm:
            return f"{name} is a {type(norm).__name__}, not the model's RMSNorm"
        if norm.weight.dtype != dtype:
            return f"{name}.weight is {norm.weight.dtype}, the activations {dtype}"
    if (attn.norm_added_q.eps, attn.norm_added_q.nemotron) != (attn.norm_added_k.eps, attn.norm_added_k.nemotron):
        return "the q and k norms differ in eps or kind"
    return None


def _check_buffers(kbuf: torch.Tensor, vbuf: torch.Tensor, kv_heads: int, start: int, g_len: int) -> None:
    """A ValueError unless kbuf / vbuf [B, KB, L, d] can take g_len positions from `start` on, as the kernels store."""
    if kbuf.stride() != vbuf.stride() or kbuf.stride(-1) != 1 or kbuf.shape[1] % kv_heads:
        raise ValueError(f"K/V buffers {tuple(kbuf.shape)} need equal strides, a contiguous last dimension and a "
                         f"multiple of {kv_heads} heads")
    if kbuf.shape[2] < start + g_len:
        raise ValueError(f"K/V buffers of {kbuf.shape[2]} positions cannot hold {g_len} from {start} on")


def generator_heads_into(attn: MoTAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                         kbuf: torch.Tensor, vbuf: torch.Tensor, start: int) -> torch.Tensor:
    """`generator_heads_into_reference` as one kernel launch (`head_epilogue_problem` is None). q, k, v may be
    column slices of one fused projection output."""
    bsz, g_len = q.shape[:2]
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = (t if t.stride(-1) == 1 and t.stride(0) == g_len * t.stride(1) else t.contiguous() for t in (q, k, v))
    _check_buffers(kbuf, vbuf, kv_heads, start, g_len)
    cos, sin = (t.expand(bsz, -1, -1).contiguous() for t in rope)  # no copy when already [B, G, d] contiguous
    out = torch.empty(bsz, g_len, heads * d, device=q.device, dtype=q.dtype)
    norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    _qkv_heads_kernel[(bsz * g_len,)](
        q, k, v, q.stride(1), k.stride(1), v.stride(1), cos, sin, d, norm_q.weight, norm_k.weight, out, kbuf, vbuf,
        kbuf.stride(0), kbuf.stride(1), kbuf.stride(2), g_len, start, norm_q.eps,
        H=heads, KH=kv_heads, REP=kbuf.shape[1] // kv_heads, D=d, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KH=triton.next_power_of_2(kv_heads), NEMOTRON=norm_q.nemotron, num_warps=8 if heads * d >= 4096 else 4,
    )
    return out.view(bsz, g_len, heads, d).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# gen-fp8: the q/k/v GEMM with this epilogue in it. The projection's output tile (128 x 256: two heads, all of q, k or
# v) is still in registers when the per-head norm and RoPE need it, so the [tokens, (H + 2K) * d] bf16 projection is
# never written and read back (Edge E7: the separate epilogue kernel was 1.49 ms of the 53 ms denoise graph).
# Measured (H200, bench/results/latency/2026-12-03-977c274-triton-gemm/): 113-116 us per Edge call against 132-165 us
# for precise cuBLAS + the epilogue kernel, E7 58.0 vs 58.5 ms; but cuBLAS's fast-accumulation q/k/v GEMM alone is
# 72 us, so with that default this stays opt-in (`EngineConfig.fp8_triton_gemms=("qkv_heads", ...)`).

QKV_TILES = TileConfig(block_m=128, block_n=256, block_k=128, group_m=8, warps=8, stages=3)

if triton is not None:

    @triton.jit
    def _store_kv_heads(buf, y, at, c, buf_h_stride, in_m, REP: tl.constexpr, D: tl.constexpr):
        """y [rows, c] (c: columns within k or v, whole heads) into buf at row offsets `at`, each K/V head repeated
        REP times (its query-head group, repeat_interleave)."""
        at = at + (c % D)[None, :]
        head = (c // D)[None, :]
        for j in tl.static_range(REP):
            tl.store(buf + at + (head * REP + j) * buf_h_stride, y, mask=in_m[:, None])

    @triton.jit
    def _fp8_qkv_heads_kernel(desc_x, xs_ptr, desc_w, ws_ptr, rope_cos, rope_sin, wq_ptr, wk_ptr, q_out, k_buf,
                              v_buf, buf_b_stride, buf_h_stride, buf_t_stride, M, K, rows_per_seq, start, eps,
                              H: tl.constexpr, KH: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, NEMOTRON: tl.constexpr):
        DTYPE = q_out.dtype.element_ty
        HT: tl.constexpr = BLOCK_N // D  # heads per tile
        HALF: tl.constexpr = D // 2
        N: tl.constexpr = (H + 2 * KH) * D
        m0, n0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            acc = tl.dot(desc_x.load([m0, k]), desc_w.load([n0, k]).T, acc)
        rows = m0 + tl.arange(0, BLOCK_M)
        in_m = rows < M
        cols = n0 + tl.arange(0, BLOCK_N)
        xs = tl.load(xs_ptr + rows, mask=in_m, other=0.0)
        ws = tl.load(ws_ptr + cols)
        y = _round(acc * xs[:, None] * ws[None, :], DTYPE)  # the projection's bf16 output, as the unfused GEMM's
        b = rows // rows_per_seq
        t = rows % rows_per_seq
        if n0 < (H + KH) * D:  # q or k heads: norm and RoPE on each head's halves
            x1, x2 = tl.split(tl.permute(tl.reshape(y, [BLOCK_M * HT, 2, HALF]), (0, 2, 1)))
            half = tl.arange(0, HALF)[None, :]
            rope_at = rows[:, None].to(tl.int64) * D + half
            cos1 = tl.load(rope_cos + rope_at, mask=in_m[:, None], other=0.0).to(tl.float32)
            cos2 = tl.load(rope_cos + rope_at + HALF, mask=in_m[:, None], other=0.0).to(tl.float32)
            sin1 = tl.load(rope_sin + rope_at, mask=in_m[:, None], other=0.0).to(tl.float32)
            sin2 = tl.load(rope_sin + rope_at + HALF, mask=in_m[:, None], other=0.0).to(tl.float32)
            cos1 = tl.reshape(tl.broadcast_to(cos1[:, None, :], [BLOCK_M, HT, HALF]), [BLOCK_M * HT, HALF])
            cos2 = tl.reshape(tl.broadcast_to(cos2[:, None, :], [BLOCK_M, HT, HALF]), [BLOCK_M * HT, HALF])
            sin1 = tl.reshape(tl.broadcast_to(sin1[:, None, :], [BLOCK_M, HT, HALF]), [BLOCK_M * HT, HALF])
            sin2 = tl.reshape(tl.broadcast_to(sin2[:, None, :], [BLOCK_M, HT, HALF]), [BLOCK_M * HT, HALF])
            if n0 < H * D:
                y1, y2 = _norm_rope(x1, x2, wq_ptr, cos1, cos2, sin1, sin2, eps, D, NEMOTRON, DTYPE)
            else:
                y1, y2 = _norm_rope(x1, x2, wk_ptr, cos1, cos2, sin1, sin2, eps, D, NEMOTRON, DTYPE)
            y = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), [BLOCK_M, BLOCK_N])
        if n0 < H * D:
            tl.store(q_out + rows[:, None].to(tl.int64) * (H * D) + cols[None, :], y.to(DTYPE), mask=in_m[:, None])
        else:
            at = b.to(tl.int64)[:, None] * buf_b_stride + (start + t).to(tl.int64)[:, None] * buf_t_stride
            if n0 < (H + KH) * D:
                _store_kv_heads(k_buf, y.to(DTYPE), at, cols - H * D, buf_h_stride, in_m, REP, D)
            else:
                _store_kv_heads(v_buf, y.to(DTYPE), at, cols - (H + KH) * D, buf_h_stride, in_m, REP, D)


def fp8_qkv_heads_problem(attn: MoTAttention, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `fp8_qkv_heads_into` cannot serve this attention module here, or None."""
    if (problem := head_epilogue_problem(attn, device, dtype)) is not None:
        return problem
    if dtype != torch.bfloat16:
        return f"the fp8 GEMM writes bf16, the model is {dtype}"
    lin = attn.add_qkv_proj
    if not isinstance(lin, Fp8Linear) or lin.bias is not None:
        return "the q/k/v projection is not one bias-free Fp8Linear"
    d, tile = attn.head_dim, QKV_TILES.block_n
    if tile % d or (attn.num_heads * d) % tile or (attn.num_kv_heads * d) % tile:
        return f"q ({attn.num_heads} heads) and k / v ({attn.num_kv_heads} heads) of {d} do not fill {tile}-wide tiles"
    return fp8_gemm_problem(1, lin.out_features, lin.in_features, device)


def fp8_qkv_heads_into(attn: MoTAttention, xq: torch.Tensor, x_scale: torch.Tensor, shape: tuple[int, int],
                       rope: Rope, kbuf: torch.Tensor, vbuf: torch.Tensor, start: int) -> torch.Tensor:
    """The q/k/v projection of the e4m3 rows xq [B*G, hidden] (scales x_scale [B*G, 1]), then `generator_heads_into`'s
    epilogue, in one kernel (`fp8_qkv_heads_problem` is None) -> q [B, H, G, d]; shape = (B, G)."""
    bsz, g_len = shape
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    _check_buffers(kbuf, vbuf, kv_heads, start, g_len)
    lin, tiles = attn.add_qkv_proj, QKV_TILES
    m, k = xq.shape
    desc_x = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [tiles.block_m, tiles.block_k])
    desc_w = TensorDescriptor(lin.weight, [lin.out_features, k], [k, 1], [tiles.block_n, tiles.block_k])
    cos, sin = (t.expand(bsz, -1, -1).contiguous() for t in rope)
    out = torch.empty(bsz, g_len, heads * d, device=xq.device, dtype=torch.bfloat16)
    norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(lin.out_features, tiles.block_n),)
    _fp8_qkv_heads_kernel[grid](
        desc_x, x_scale.reshape(-1), desc_w, lin.weight_scale, cos, sin, norm_q.weight, norm_k.weight, out, kbuf,
        vbuf, kbuf.stride(0), kbuf.stride(1), kbuf.stride(2), m, k, g_len, start, norm_q.eps, H=heads, KH=kv_heads,
        REP=kbuf.shape[1] // kv_heads, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, NEMOTRON=norm_q.nemotron, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out.view(bsz, g_len, heads, d).transpose(1, 2)
