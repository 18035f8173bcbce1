"""Quantization recipes applied to a loaded model by module swap, their quality check (per-layer
SQNR) and loadable, hash-verified artifacts. See docs/quant.md."""

from .artifact import is_artifact, load_artifact, write_artifact
from .errors import (
    ArtifactError,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ArtifactMissingFileError,
    RecipeError,
)
from .fp8 import Fp8Linear, fp8_linear_reference, fp8_linear_scaled_mm, quantize_rowwise_fp8
from .int8 import Int8WeightOnlyLinear, quantize_rowwise_int8
from .recipes import FP8_W8A8, INT8_W8A16, RECIPES, Recipe, Rule, get_recipe
from .sqnr import LayerSQNR, failing, format_table, layer_sqnr, sqnr_db, unexercised
from .swap import quantize_model, quantized_modules, select_modules, set_kernel

__all__ = [
    "FP8_W8A8",
    "INT8_W8A16",
    "RECIPES",
    "ArtifactError",
    "ArtifactIntegrityError",
    "ArtifactMismatchError",
    "ArtifactMissingFileError",
    "Fp8Linear",
    "Int8WeightOnlyLinear",
    "LayerSQNR",
    "Recipe",
    "RecipeError",
    "Rule",
    "failing",
    "format_table",
    "fp8_linear_reference",
    "fp8_linear_scaled_mm",
    "get_recipe",
    "is_artifact",
    "layer_sqnr",
    "load_artifact",
    "quantize_model",
    "quantize_rowwise_fp8",
    "quantize_rowwise_int8",
    "quantized_modules",
    "select_modules",
    "set_kernel",
    "sqnr_db",
    "unexercised",
    "write_artifact",
]


def quantize_main(argv: list[str] | None = None) -> int:
    from ..cli.quantize import quantize_main as _main

    return _main(argv)
