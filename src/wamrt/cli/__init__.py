"""`wamrt` command line."""

from __future__ import annotations

import argparse
import sys

from .. import __version__


def build_parser() -> argparse.ArgumentParser:
    from . import infer as infer_cli

    ap = argparse.ArgumentParser(prog="wamrt", description="World-Action Model runtime for Cosmos 3")
    ap.add_argument("--version", action="version", version=f"wamrt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    infer = sub.add_parser("infer", help="one DROID policy request -> [32, 8] action chunk + stage timings",
                           description="Without image/state arguments a built-in sample observation is used.")
    infer_cli.add_arguments(infer)
    infer.set_defaults(func=infer_cli.run)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    lat = bench.add_parser("latency", help="latency waterfall E0..E5 on random full-size weights (GPU)")
    from ..bench import latency

    latency.add_arguments(lat)
    lat.set_defaults(func=latency.run)
    world = bench.add_parser("world", help="world generation (t2i, i2v) end to end vs diffusers on random weights")
    from ..bench import world as world_bench

    world_bench.add_arguments(world)
    world.set_defaults(func=world_bench.run)
    kern = bench.add_parser("kernels", help="the Generator's GEMM call sites: cuBLAS + Inductor vs quack's fused "
                            "epilogues, at real shapes (GPU)")
    from ..bench import kernels as kernels_bench

    kernels_bench.add_arguments(kern)
    kern.set_defaults(func=kernels_bench.run)
    par = bench.add_parser("parallel", help="latency on 2 GPUs: --parallel cfg (vs one GPU) or tp (Super)")
    from ..bench import parallel as parallel_bench

    parallel_bench.add_arguments(par)
    par.set_defaults(func=parallel_bench.run)
    chart = bench.add_parser("waterfall", help="one chart from committed latency result files (rows of several runs, "
                             "each labelled with its commit)")
    from ..bench import waterfall as waterfall_bench

    waterfall_bench.add_arguments(chart)
    chart.set_defaults(func=waterfall_bench.run)
    timeline = bench.add_parser("timeline", help="a saved --trace request's GPU timeline: busy, idle, segments, gaps")
    from ..bench import timeline as timeline_bench

    timeline_bench.add_arguments(timeline)
    timeline.set_defaults(func=timeline_bench.run)
    serve = sub.add_parser("serve", help="policy server: openpi websocket, /v1/policy/infer, /v1/videos")
    load = bench.add_parser("load", help="closed-loop websocket lanes against a loopback server")
    generate = sub.add_parser("generate", help="text / image / video -> an MP4 (with sound) or a PNG, one request",
                              description="World generation as POST /v1/videos/sync runs it, with a progress bar.")
    try:  # the server stack is an extra (wamrt[server]); everything else works without it
        from ..bench import load as load_bench
        from ..serving import server as serve_cli
        from . import generate as generate_cli
    except ImportError as e:
        missing = str(e)
        for p in (serve, load, generate):
            p.set_defaults(func=lambda _args: _missing_extra("server", missing))
    else:
        serve_cli.add_arguments(serve)
        serve.set_defaults(func=serve_cli.run)
        load_bench.add_arguments(load)
        load.set_defaults(func=load_bench.run)
        generate_cli.add_arguments(generate)
        generate.set_defaults(func=generate_cli.run)
    quantize = sub.add_parser("quantize", help="write a quantized, hash-verified artifact "
                              "(gen-fp8, gen-fp8+reasoner-w8, all-fp8)")
    from ..quant import cli as quant_cli

    quant_cli.add_arguments(quantize)
    quantize.set_defaults(func=quant_cli.run)
    from . import sim as sim_cli  # light: each simulator command imports mujoco/pyarrow itself

    sim_cli.add_subcommands(sub)
    from . import train as train_cli

    train_cli.add_subcommands(sub)
    from . import demo as demo_cli

    demo_cli.add_subcommands(sub)
    return ap


def _missing_extra(extra: str, why: str) -> int:
    print(f"error: this command needs the '{extra}' extra (pip install 'wamrt[{extra}]'): {why}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
