"""`wamrt quantize --model PATH --recipe R --out DIR`.

The recipes here use dynamic per-token activation scales and weight scales computed from the
weights, so no calibration data is read. Given a pipeline root (with transformer/, vae/, tokenizer),
the artifact goes to OUT/transformer/ and the other components are copied next to it, so
`--model OUT` serves like the source did. The parser is standard library only (see `wamrt.cli`); torch and the
quantizer load when the command runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

RECIPES = ("all-fp8", "gen-fp8", "gen-fp8+reasoner-w8", "gen-fp8-skip-first")  # sorted(quant.recipes.RECIPES)
DTYPES = ("bfloat16", "float16", "float32")  # of the tensors left unquantized


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True,
                    help="transformer folder, pipeline root (diffusers layout) or a model name (panda-droid)")
    ap.add_argument("--recipe", required=True, choices=RECIPES,
                    help="what to quantize and how (docs/quant.md)")
    ap.add_argument("--out", required=True, help="artifact folder to create")
    ap.add_argument("--device", default="cpu", help="where to quantize (cuda is faster for full sizes)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                    help="dtype of the tensors left unquantized (default: bfloat16)")
    ap.add_argument("--force", action="store_true", help="replace an existing non-empty --out")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model import load_transformer, resolve_transformer_folder
    from ..quant.artifact import write_artifact
    from ..quant.errors import ArtifactError, RecipeError

    src = Path(args.model)
    if not src.exists():  # a model name as `wamrt serve --model` takes it (a built-in is built on first use)
        from ..pipeline.policy import checkpoint_root

        src = checkpoint_root(args.model)
    out = Path(args.out)
    t0 = time.perf_counter()
    try:
        folder = resolve_transformer_folder(src)
        model = load_transformer(folder, device=args.device, dtype=getattr(torch, args.dtype))
        pipeline_root = folder != src  # source had transformer/ under it
        target = out / "transformer" if pipeline_root else out
        if pipeline_root and out.exists() and any(out.iterdir()) and not args.force:
            raise FileExistsError(f"{out} exists and is not empty (pass --force)")
        write_artifact(model, args.recipe, target, overwrite=args.force, source=str(src))
        if pipeline_root:
            for item in src.iterdir():
                if item.name == "transformer" or item.name.startswith("."):
                    continue
                dst = out / item.name
                if item.is_dir():
                    shutil.copytree(item, dst, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, dst)
    except (ArtifactError, RecipeError, FileExistsError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.recipe} artifact to {target} in {time.perf_counter() - t0:.1f} s "
          "(dynamic activation scales: no calibration data used)")
    return 0


def quantize_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wamrt quantize", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))
