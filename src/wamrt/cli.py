"""`wamrt` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(size=args.size, device=args.device, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wamrt", description="World-Action Model runtime for Cosmos 3")
    ap.add_argument("--version", action="version", version=f"wamrt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build a tiny random checkpoint, load it, run one forward, print timings")
    demo.add_argument("--size", default="tiny-qwen", help="model size from the registry (tiny-qwen, tiny-edge)")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
