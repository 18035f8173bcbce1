"""`wamrt` command line (also `python -m wamrt`).

Building the parser imports the standard library only: every parser lives in this package, and each command's
module (torch, diffusers, the server) is imported when the command runs, so `wamrt --help` answers at once.
A command that needs an extra (server, sim) names it before its arguments are parsed.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..provenance import git_sha
from .dispatch import Parser, lazy, missing_extra


def build_parser() -> argparse.ArgumentParser:
    from . import bench, chat, demo, generate, infer, quantize, serve, sim, train

    ap = Parser(prog="wamrt", description="World-Action Model runtime for NVIDIA Cosmos 3: serve a policy to robots, "
                "generate video, evaluate in simulation.")
    ap.add_argument("--version", action="version", version=f"wamrt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="policy server: openpi websocket, /v1/policy/infer, /v1/videos",
                       description="Serve a checkpoint to robots (openpi websocket) and over HTTP. Needs the server "
                                   "extra: pip install 'wamrt[server]'.")
    serve.add_arguments(p)
    p.set_defaults(func=lazy("wamrt.serving.server:run"))

    p = sub.add_parser("infer", help="one DROID policy request -> [32, 8] action chunk + stage timings",
                       description="Without image/state arguments a built-in sample observation is used.")
    infer.add_arguments(p)
    p.set_defaults(func=infer.run)

    p = sub.add_parser("generate", help="text / image / video -> an MP4 (with sound) or a PNG, one request",
                       description="World generation as POST /v1/videos/sync runs it, with a progress bar. Needs the "
                                   "server extra: pip install 'wamrt[server]'.")
    generate.add_arguments(p)
    p.set_defaults(func=generate.run)

    p = sub.add_parser("chat", help="a terminal conversation with the checkpoint's Reasoner (streamed)",
                       description="Text (and images, with a vision_encoder/) in; the Reasoner's answer streamed out.")
    chat.add_arguments(p)
    p.set_defaults(func=chat.run)

    p = sub.add_parser("quantize", help="write a quantized, hash-verified artifact "
                       "(gen-fp8, gen-fp8+reasoner-w8, all-fp8)")
    quantize.add_arguments(p)
    p.set_defaults(func=quantize.run)

    sim.add_subcommands(sub)  # rollout, eval gate, demos record, export lerobot
    demo.add_subcommands(sub)
    train.add_subcommands(sub)
    bench.add_subcommands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if problem := missing_extra(argv):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    git_sha()  # pinned now: result files written later in this process name the code it started with
    return int(args.func(args) or 0)
