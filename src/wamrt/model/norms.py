"""RMSNorm in the two numerical flavours Cosmos 3 checkpoints were trained with.

The rounding points matter for bf16 parity with the reference, so each flavour keeps them:
* Qwen-stack checkpoints (SiLU): statistics in fp32, normalised values rounded to the weight's half
  dtype, then multiplied by the (half) weight.
* Nemotron-stack checkpoints (ReLU^2, Edge): everything in fp32 including the weight multiply, one
  rounding at the end.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, nemotron: bool) -> None:
        super().__init__()
        self.eps = eps
        self.nemotron = nemotron
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nemotron:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight.float() * xf).to(x.dtype)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(variance + self.eps)  # promotes to fp32
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(self.weight.dtype)
        return y * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, nemotron={self.nemotron}"
