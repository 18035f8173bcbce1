"""cuDNN's fp8 SDPA forward (nvidia-cudnn-frontend's graph API) at the Generator call's shape, for
scripts/fp8_attention_probe.py: per-tensor e4m3 q, k, v (descale = amax / 448), P scaled by 448, O in e4m3 (Hopper
has no bf16 O for fp8 SDPA), keys masked past each sequence's length (padding mask). Timed in a CUDA graph on the
handle's stream; SQNR of O (dequantized) against fp32 attention on the bf16 inputs."""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn


def _bshd_strides(s: int, h: int, d: int) -> list[int]:
    return [s * h * d, d, h * d, 1]  # [B, H, S, d] dims over [B, S, H, d] memory


def cudnn_fp8_rows(q, k, v, used, ref, dv, iters, sqnr_db) -> dict:
    """sqnr_db(reference, test) as wamrt.quant.sqnr has it."""
    import cudnn

    dev = q.device
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    dt = cudnn.data_type
    out: dict = {"frontend": cudnn.__version__, "backend": cudnn.backend_version(),
                 "torch_cudnn": torch.backends.cudnn.version()}
    stream = torch.cuda.Stream(device=dev)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.cuda_stream)

    def f32(x):
        return torch.full((1, 1, 1, 1), float(x), dtype=torch.float32, device=dev)

    def quant(x_bshd):
        amax = x_bshd.float().abs().amax().clamp(min=1e-12)
        return (x_bshd.float() * (448.0 / amax)).to(E4M3), f32(amax / 448.0)

    q8, dq = quant(q.transpose(1, 2).contiguous())
    k8, dk = quant(k.transpose(1, 2).contiguous())
    v8, dvt = quant(v.transpose(1, 2).contiguous())
    o8 = torch.empty(b, sq, hq, d, dtype=E4M3, device=dev)
    scale_o = 0.5 / dvt
    tensors = {"descale_q": dq, "descale_k": dk, "descale_v": dvt, "descale_s": f32(1 / 448.0),
               "scale_s": f32(448.0), "scale_o": scale_o, "amax_s": f32(0), "amax_o": f32(0)}
    seq_q = torch.full((b, 1, 1, 1), sq, dtype=torch.int32, device=dev)
    seq_kv = used.to(torch.int32).view(b, 1, 1, 1).contiguous()
    for stats in (False, True):
        try:
            g = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT,
                              compute_data_type=dt.FLOAT, handle=handle)
            tq = g.tensor(name="q", dim=[b, hq, sq, d], stride=_bshd_strides(sq, hq, d), data_type=dt.FP8_E4M3)
            tk = g.tensor(name="k", dim=[b, hkv, skv, d], stride=_bshd_strides(skv, hkv, d), data_type=dt.FP8_E4M3)
            tv = g.tensor(name="v", dim=[b, hkv, skv, d], stride=_bshd_strides(skv, hkv, d), data_type=dt.FP8_E4M3)
            sc = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
                  for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
            tsq = g.tensor(name="seq_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
            tskv = g.tensor(name="seq_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
            o, st, amax_s, amax_o = g.sdpa_fp8(tq, tk, tv, *(sc[n] for n in ("descale_q", "descale_k", "descale_v",
                                                                             "descale_s", "scale_s", "scale_o")),
                                               generate_stats=stats, attn_scale=1.0 / math.sqrt(d),
                                               use_causal_mask=False, use_padding_mask=True, seq_len_q=tsq,
                                               seq_len_kv=tskv, name="sdpa_fp8")
            o.set_output(True).set_dim([b, hq, sq, d]).set_stride(_bshd_strides(sq, hq, d)).set_data_type(dt.FP8_E4M3)
            for a in (amax_s, amax_o):
                a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
            stats_t = None
            if stats:
                stats_t = torch.empty(b, hq, sq, 1, dtype=torch.float32, device=dev)
                st.set_output(True).set_dim([b, hq, sq, 1]).set_stride([hq * sq, sq, 1, 1]).set_data_type(dt.FLOAT)
            g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
            pack = {tq: q8.transpose(1, 2), tk: k8.transpose(1, 2), tv: v8.transpose(1, 2), o: o8.transpose(1, 2),
                    amax_s: tensors["amax_s"], amax_o: tensors["amax_o"], tsq: seq_q, tskv: seq_kv,
                    **{sc[n]: tensors[n] for n in sc}}
            if stats:
                pack[st] = stats_t
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    g.execute(pack, ws, handle=handle)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            got = (o8.float() / scale_o.view(1)).transpose(1, 2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(iters):
                    g.execute(pack, ws, handle=handle)
            times = []
            for _ in range(7):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()  # replay runs on the current stream, whatever stream captured it
                graph.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / iters)
            out[f"stats_{stats}"] = {"ms": sorted(times)[3], "sqnr_db": sqnr_db(ref, got)}
            break
        except Exception as e:  # what the backend declines, with its reason
            out[f"stats_{stats}"] = {"error": repr(e)[:600]}
    return out
