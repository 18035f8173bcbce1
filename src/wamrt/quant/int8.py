"""Weight-only int8 linear (W8A16): int8 weight [N, K] with an fp32 per-output-channel scale [N].

Activations stay in the model dtype. The per-channel scale factors out of the dot product, so the
GEMM runs on the int8 weight cast to the activation dtype (int8 values are exact in bf16) and the
scale is applied to the output.
"""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127.0
_AMAX_FLOOR = 1e-12


def quantize_rowwise_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (int8 [..., K], fp32 scale [...]); symmetric per row of K, round to nearest (ties to even)."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR) / INT8_MAX
    q = torch.round(wf / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        if not w.is_meta:
            q, scale = quantize_rowwise_int8(w)
            mod.weight.copy_(q)
            mod.weight_scale.copy_(scale)
            if linear.bias is not None:
                mod.bias.data.copy_(linear.bias.detach())
        return mod

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Scale in fp32: rounding the scale to bf16 would be a fixed per-channel gain error.
        out = (nn.functional.linear(x, self.weight.to(x.dtype)).float() * self.weight_scale).to(x.dtype)
        return out + self.bias.to(out.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
