"""`wamrt bench kernels`: the Generator layer's GEMM call sites, each as the engine runs it today (cuBLAS GEMM,
Inductor's elementwise kernel after it) and with the elementwise work in the GEMM's epilogue (quack), at the real
shapes (both CFG branches: 6,186 tokens at tier 480). Prints and writes one JSON file: median ms, TFLOP/s, and
the first call's time of each quack kernel (its CuTe DSL compile, paid once per kernel at warm-up). `--sweep` times
the tile configurations of `engine.epilogues.SWEEP_TILES`; the winners go into `SM90_SITES`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.epilogues import act_reference, quack_available
from ..model.config import get_config
from ..provenance import environment


def _median_ms(fn: Callable[[], object], iters: int, reps: int = 10) -> tuple[float, str]:
    """Median ms per call, and how it was timed: `reps` calls captured in one CUDA graph and replayed (the engine's
    regime: no launch overhead between kernels), or, where capture fails, `reps` calls launched back to back."""
    graph = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:  # noqa: BLE001 - a kernel that cannot be captured is timed on the stream instead
        graph = None
        torch.cuda.synchronize()
    run = graph.replay if graph is not None else lambda: [fn() for _ in range(reps)]
    run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2], ("graph" if graph is not None else "stream")


def call_sites(model: str) -> list[dict]:
    cfg = get_config(model)
    h, d = cfg.hidden_size, cfg.head_dim
    attn = cfg.num_attention_heads * d
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    up = 2 * cfg.intermediate_size if cfg.gated_mlp else cfg.intermediate_size
    act = "swiglu" if cfg.gated_mlp else "relu_sq"
    return [
        dict(site="qkv", k=h, n=qkv, epilogue=None),
        dict(site="out+residual", k=attn, n=h, epilogue="residual"),
        dict(site=f"up+{act}", k=h, n=up, epilogue=act),
        dict(site="down+residual", k=cfg.intermediate_size, n=h, epilogue="residual"),
    ]


def measure_site(site: dict, *, m: int, iters: int, device: torch.device, sweep: bool) -> dict:
    from ..engine.epilogues import SWEEP_TILES, gemm_act_2d, gemm_config, gemm_residual_2d

    gen = torch.Generator(device=device).manual_seed(0)
    k, n, epi = site["k"], site["n"], site["epilogue"]
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
    res = torch.randn(m, n, device=device, generator=gen).bfloat16()
    if epi is None:
        from quack.gemm_interface import gemm_tuned

        inductor = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
        out_buf = torch.empty_like(res)

        def cublas():
            return inductor(x, w)

        def quack(cfg):
            return gemm_tuned.fn(x, w.t(), out_buf, None, config=cfg)  # plain GEMM, no epilogue
    elif epi == "residual":
        inductor = torch.compile(lambda x, w, r: r + F.linear(x, w), dynamic=False)

        def cublas():
            return inductor(x, w, res)

        def quack(cfg):
            return gemm_residual_2d(x, w, res, cfg)
    else:
        inductor = torch.compile(lambda x, w: act_reference(F.linear(x, w), epi), dynamic=False)

        def cublas():
            return inductor(x, w)

        def quack(cfg):
            return gemm_act_2d(x, w, epi, cfg)
    variants: dict[str, Callable[[], object]] = {"cublas": cublas}
    for tiles in SWEEP_TILES if sweep else SWEEP_TILES[:1]:
        variants["quack " + "x".join(map(str, tiles))] = (lambda c: lambda: quack(c))(gemm_config(tiles))
    out = {**site, "m": m, "tflop": 2 * m * k * n / 1e12, "variants": {}}
    for name, fn in variants.items():
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            for _ in range(3):
                fn()
            ms, timing = _median_ms(fn, iters)
        except Exception as e:  # a tile shape the kernel refuses for this epilogue: recorded, not fatal
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        out["variants"][name] = {"ms": ms, "tflops": out["tflop"] / (ms / 1e3), "first_call_s": first,
                                 "timing": timing}
    timed = {k: v for k, v in out["variants"].items() if "ms" in v and k != "cublas"}
    if timed and "ms" in out["variants"]["cublas"]:
        best = min(timed, key=lambda k: timed[k]["ms"])
        out["best_quack"] = best
        out["quack_speedup"] = out["variants"]["cublas"]["ms"] / timed[best]["ms"]
    return out


def run(args: argparse.Namespace) -> int:
    dev = torch.device("cuda")
    if not quack_available(dev):
        raise SystemExit("bench kernels needs a Hopper / Blackwell GPU and quack-kernels (comes with flash-attn-4)")
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment()
    command = "wamrt bench kernels " + " ".join(sys.argv[3:])
    rows = []
    for model in args.models:
        for site in call_sites(model):
            r = {"model": model, **measure_site(site, m=args.tokens, iters=args.iters, device=dev, sweep=args.sweep)}
            rows.append(r)
            print(f"{model:5s} {r['site']:15s} M{r['m']} K{r['k']} N{r['n']}:", flush=True)
            for name, v in r["variants"].items():
                print(f"    {name:28s} " + (f"{v['ms']:.3f} ms {v['tflops']:5.0f} TFLOP/s ({v['timing']}) first call "
                                            f"{v['first_call_s']:.1f} s" if "ms" in v else v["error"]), flush=True)
            print(f"    best quack {r.get('best_quack')}: x{r.get('quack_speedup', float('nan')):.3f} vs cuBLAS",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"kind": "kernels", "command": command, **env, "tokens": args.tokens, "iters": args.iters,
              "note": "per call site: cuBLAS GEMM + Inductor elementwise kernel (compiled) vs quack GEMM with the "
                      "elementwise work in its epilogue; per variant 10 calls in one CUDA graph (or back to back "
                      "where capture fails, timing 'stream'), median over iters replays, per call",
              "sites": rows}
    (out / "kernels.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0
