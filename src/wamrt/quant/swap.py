"""Apply a recipe to a loaded model by swapping `nn.Linear` modules; model code is never edited.

Order: fuse first (the engine's `fuse_generator`), then quantize the fused linears. Per-output-channel
weight scales make "quantize the fused matrix" identical to "quantize each part and concatenate", and
the fused q/k/v (gate/up) GEMM reads one activation, so that activation is quantized once. The engine
calls `fuse_generator` again on load; it is idempotent, so a quantized model passes through untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import Cosmos3Transformer
from .fp8 import KERNELS, Fp8Linear, resolve_kernel
from .int8 import Int8WeightOnlyLinear
from .recipes import FP8_W8A8, INT8_W8A16, Recipe, get_recipe

QUANTIZED_TYPES = (Fp8Linear, Int8WeightOnlyLinear)
RECIPE_ATTR = "_wamrt_quant_recipe"  # set on a quantized model instance; read by write_artifact


def select_modules(model: nn.Module, recipe: str | Recipe) -> dict[str, str]:
    """Qualified name -> format of every plain `nn.Linear` the recipe quantizes, in module order."""
    rec = get_recipe(recipe)
    chosen: dict[str, str] = {}
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear:  # exact type: quantized modules are not re-selected
            fmt = rec.format_of(name)
            if fmt is not None:
                chosen[name] = fmt
    return chosen


def _quantized(linear: nn.Linear, fmt: str, kernel: str) -> nn.Module:
    if fmt == FP8_W8A8:
        return Fp8Linear.from_linear(linear, kernel=kernel)
    if fmt == INT8_W8A16:
        return Int8WeightOnlyLinear.from_linear(linear)
    raise AssertionError(fmt)  # Rule validates formats


def quantize_model(model: Cosmos3Transformer, recipe: str | Recipe, *, kernel: str = "auto",
                   fuse: bool | None = None) -> dict[str, str]:
    """Quantize `model` in place per `recipe`; returns the swapped names and formats.

    Works on the meta device too (then only the module structure changes: used to build the
    skeleton an artifact is loaded into). `fuse=None` follows the recipe.
    """
    rec = get_recipe(recipe)
    if getattr(model, RECIPE_ATTR, None) is not None:
        raise ValueError(f"model is already quantized with recipe {getattr(model, RECIPE_ATTR)!r}")
    if rec.fused if fuse is None else fuse:
        # Imported here: `wamrt.engine` pulls in the pipeline (VAE, diffusers), ~5 s on a cold start.
        from ..engine.fuse import fuse_generator

        fuse_generator(model)
    chosen = select_modules(model, rec)
    for name, fmt in chosen.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, attr, _quantized(getattr(owner, attr), fmt, kernel))  # original freed here
    setattr(model, RECIPE_ATTR, rec.name)
    return chosen


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_TYPES)}


def set_kernel(model: nn.Module, kernel: str, device: torch.device | str | None = None) -> None:
    """Switch every Fp8Linear to `scaled_mm`, `reference` or `auto`; with a device, 'auto' is resolved
    now to that device's path (do this before torch.compile / CUDA graph capture)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if device is not None:
        kernel = resolve_kernel(kernel, torch.device(device))
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.kernel = kernel
