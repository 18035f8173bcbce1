"""Per-layer SQNR of every swapped linear against its original, on activations the caller supplies.

Hooks on the quantized model record each quantized linear's input and output; the original linear
(looked up by name in an unquantized copy of the model) is applied to the *same* input in fp32. So
each row measures that layer's own quantization error, not the error accumulated upstream.
SQNR = 10 log10(sum ref^2 / sum (ref - quant)^2), summed over every call of the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fp8 import Fp8Linear
from .recipes import FP8_W8A8, INT8_W8A16
from .swap import quantized_modules

# A fused linear of the quantized model, rebuilt from the parts of an unfused reference model.
FUSED_PARTS = {
    "add_qkv_proj": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
SQNR_BAR_DB = 25.0  # issue 7's per-layer bar


@dataclass
class LayerSQNR:
    name: str
    fmt: str
    calls: int
    signal: float  # sum of ref^2
    noise: float  # sum of (ref - quant)^2

    @property
    def sqnr_db(self) -> float:
        if self.calls == 0:
            return math.nan  # never ran on the supplied inputs: no measurement
        if self.noise == 0.0:
            return math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.detach().double(), test.detach().double()
    noise = float((ref - test).square().sum())
    return math.inf if noise == 0.0 else 10.0 * math.log10(float(ref.square().sum()) / noise)


def _reference_weights(reference: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    try:
        mod = reference.get_submodule(name)
        if mod is not None:
            return mod.weight, mod.bias
    except AttributeError:
        pass
    owner_name, _, attr = name.rpartition(".")
    if attr not in FUSED_PARTS:
        raise KeyError(f"reference model has no linear {name}")
    owner = reference.get_submodule(owner_name)
    parts = [getattr(owner, p) for p in FUSED_PARTS[attr]]
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    return torch.cat([p.weight for p in parts]), bias


def layer_sqnr(
    reference: nn.Module, quantized: nn.Module, run: Callable[[nn.Module], Any]
) -> list[LayerSQNR]:
    """Call `run(quantized)` (e.g. a forward on recorded observations) and return one row per
    quantized linear, in module order. `reference` is the unquantized model (fused or not)."""
    rows: dict[str, LayerSQNR] = {}
    handles = []

    def hook_for(name: str, w: torch.Tensor, b: torch.Tensor | None) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x = args[0]
            bias = None if b is None else b.float().to(x.device)
            ref = nn.functional.linear(x.float(), w.float().to(x.device), bias)
            row = rows[name]
            row.calls += 1
            row.signal += float(ref.double().square().sum())
            row.noise += float((ref.double() - out.double()).square().sum())
        return hook

    for name, mod in quantized_modules(quantized).items():
        fmt = FP8_W8A8 if isinstance(mod, Fp8Linear) else INT8_W8A16
        rows[name] = LayerSQNR(name, fmt, 0, 0.0, 0.0)
        w, b = _reference_weights(reference, name)
        handles.append(mod.register_forward_hook(hook_for(name, w, b)))
    try:
        with torch.no_grad():
            run(quantized)
    finally:
        for h in handles:
            h.remove()
    return list(rows.values())


def format_table(rows: list[LayerSQNR], bar_db: float = SQNR_BAR_DB) -> str:
    """Markdown table; rows under the bar are flagged."""
    lines = ["| layer | format | calls | SQNR dB | >= bar |", "|---|---|---|---|---|"]
    for r in rows:
        ok = "not run" if r.calls == 0 else ("yes" if r.sqnr_db >= bar_db else "**NO**")
        lines.append(f"| {r.name} | {r.fmt} | {r.calls} | {r.sqnr_db:.2f} | {ok} |")
    return "\n".join(lines)


def failing(rows: list[LayerSQNR], bar_db: float = SQNR_BAR_DB) -> list[LayerSQNR]:
    """Measured rows under the bar."""
    return [r for r in rows if r.calls > 0 and r.sqnr_db < bar_db]


def unexercised(rows: list[LayerSQNR]) -> list[LayerSQNR]:
    """Layers the run never called: no measurement, so no pass either. (In a full forward these are
    the last layer's Reasoner `to_out` and MLP, whose output nothing reads.)"""
    return [r for r in rows if r.calls == 0]
