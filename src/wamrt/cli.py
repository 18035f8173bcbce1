"""`wamrt` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    from . import infer_cli

    ap = argparse.ArgumentParser(prog="wamrt", description="World-Action Model runtime for Cosmos 3")
    ap.add_argument("--version", action="version", version=f"wamrt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    infer = sub.add_parser("infer", help="one DROID policy request -> [32, 8] action chunk + stage timings",
                           description="Without image/state arguments a built-in sample observation is used.")
    infer_cli.add_arguments(infer)
    infer.set_defaults(func=infer_cli.run)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
