"""FlashAttention-3's forward (`fa3-fwd`, a forward-only build of flash-attention's hopper/ kernels on the libtorch
stable ABI) at the Generator call's shape, for scripts/fp8_attention_probe.py: bf16 as the engine would call it (one
call for both CFG rows, GQA in the kernel, each row's key count as seqused_k) at a few scheduling options, and its e4m3
forward with one descale per (row, K/V head) for q, k and v. Timed in a CUDA graph; SQNR against fp32 attention on
the bf16 inputs."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def _quantize_per_kv_head(x_bshd: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, H, d] -> (e4m3 [B, S, H, d], descale [B, kv_heads] fp32): one scale per row and K/V head group."""
    b, s, h, d = x_bshd.shape
    grouped = x_bshd.float().reshape(b, s, kv_heads, h // kv_heads, d)
    amax = grouped.abs().amax(dim=(1, 3, 4)).clamp(min=1e-12)  # [B, kv_heads]
    scale = 448.0 / amax
    q8 = (grouped * scale[:, None, :, None, None]).reshape(b, s, h, d).to(E4M3)
    return q8, (1.0 / scale).contiguous()


def fa3_rows(q, k, v, used, ref, iters, sqnr_db, graph_ms) -> dict:
    """q [B, H, G, d] (a view of [B, G, H, d]), k / v [B, Hkv, Sk, d]; used [B] int32 key counts.
    sqnr_db(reference, test) and graph_ms(fn, iters) as the probe has them."""
    from fa3_fwd_interface import _flash_attn_forward

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, S, H, d]
    kt, vt = kt.contiguous(), vt.contiguous()  # the kernel wants the last dim contiguous and rows of heads
    out: dict = {"package": "fa3-fwd 0.0.3"}

    def call(qq, kk, vv, **kw):
        return _flash_attn_forward(qq, kk, vv, seqused_k=used, **kw)[0]

    rows = []
    for pack_gqa in (None, True, False):
        for num_splits in (1, 0):  # 0: the kernel's heuristic
            kw = dict(pack_gqa=pack_gqa, num_splits=num_splits)
            entry = {"pack_gqa": pack_gqa, "num_splits": num_splits}
            try:
                got = call(qt, kt, vt, **kw).transpose(1, 2)
                entry["sqnr_db"] = sqnr_db(ref, got)
                entry["ms"] = graph_ms(lambda kw=kw: call(qt, kt, vt, **kw), iters)
            except Exception as e:  # an option this build refuses
                entry["error"] = repr(e)[:400]
            print("fa3 bf16", entry, flush=True)
            rows.append(entry)
    out["bf16"] = rows

    kv_heads = k.shape[1]
    try:
        q8, qd = _quantize_per_kv_head(qt, kv_heads)
        k8, kd = _quantize_per_kv_head(kt, kv_heads)
        v8, vd = _quantize_per_kv_head(vt, kv_heads)
        kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        got = call(q8, k8, v8, **kw).transpose(1, 2)
        out["fp8"] = {"out_dtype": str(got.dtype), "sqnr_db": sqnr_db(ref, got.to(ref.dtype)),
                      "ms": graph_ms(lambda: call(q8, k8, v8, **kw), iters),
                      "quantize_ms": graph_ms(lambda: (_quantize_per_kv_head(qt, kv_heads),
                                                        _quantize_per_kv_head(kt, kv_heads),
                                                        _quantize_per_kv_head(vt, kv_heads)), iters)}
        print("fa3 fp8", out["fp8"], flush=True)
    except Exception as e:
        out["fp8"] = {"error": repr(e)[:600]}
        print("fa3 fp8", out["fp8"], flush=True)
    return out
