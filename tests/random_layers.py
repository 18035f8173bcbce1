"""A one-layer Cosmos 3 model with random weights and non-trivial norm gains, for kernel tests (importable from every
test module: pyproject puts `tests/` on the path)."""

from __future__ import annotations

from dataclasses import replace

import torch

from wamrt.model import Cosmos3Transformer
from wamrt.model.config import CONFIGS, Cosmos3Config


def one_layer_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32
                    ) -> tuple[Cosmos3Transformer, Cosmos3Config]:
    """CONFIGS[name] cut to one layer, seeded: weights N(0, 1/fan_in), norm gains U(0.5, 1.5)."""
    cfg = replace(CONFIGS[name], num_hidden_layers=1, vocab_size=512)
    torch.manual_seed(0)
    model = Cosmos3Transformer(cfg).to(device, dtype)
    with torch.no_grad():
        for p in model.layers.parameters():
            p.normal_(0, p.shape[-1] ** -0.5) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model, cfg
