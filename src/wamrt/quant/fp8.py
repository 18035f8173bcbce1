"""FP8 e4m3 W8A8 linear: per-output-channel weight scales, dynamic per-token activation scales.

Four execution paths compute the same function:
* `scaled_mm`: `torch._scaled_mm` with rowwise scales (cuBLASLt fp8 GEMM, fp32 accumulate,
  scales applied in the epilogue, bf16 out). Needs K and N multiples of 16.
* `scaled_mm_fast`: the same with `use_fast_accum`: the fp8 tensor cores' partial sums stay in their
  reduced-precision accumulator across K instead of being promoted to fp32 every 128 elements. Lossy, by a
  measured amount far below the e4m3 noise (docs/engine.md); what the engine's fused gen-fp8 layer runs by default.
* `triton`: `ops.fp8_gemm`, a Triton TMA kernel of the same contract that accumulates as `scaled_mm_fast` does
  (Hopper).
`scaled_mm_fast` and `triton` are GPU kernels; off CUDA they run the reference.
* `reference`: dequantize both operands to fp32 and matmul. Plain PyTorch, used on CPU and as the
  oracle the kernel path is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fp8_gemm import fp8_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Floor on the absmax so an all-zero row (padding tokens, dead channels) gets a finite scale.
_AMAX_FLOOR = 1e-12
KERNELS = ("auto", "scaled_mm", "scaled_mm_fast", "triton", "reference")


def quantize_rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scale [..., 1]) with x ~= q * scale, one scale per row.

    Used for weights (rows = output channels) and activations (rows = tokens). The scale maps each
    row's absmax onto the e4m3 max, so nothing saturates; the clamp only guards rounding at the edge.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_reference(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M, 1], wq [N, K] e4m3, w_scale [N] -> [M, N] (fp32 math)."""
    out = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_linear_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = False,
) -> torch.Tensor:
    """Same contract as `fp8_linear_reference`, on `torch._scaled_mm` (rowwise scaling)."""
    # Rowwise scaling needs a bf16 output; wq.t() is the column-major [K, N] operand cuBLASLt wants.
    out = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


_CAPABLE: dict[int, bool] = {}  # per CUDA device index; filled once, outside any compiled region


def scaled_mm_supported(device: torch.device) -> bool:
    """Hopper/Ada (sm 8.9+) have fp8 tensor cores; elsewhere the reference path runs."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _CAPABLE[index]


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'auto' -> the concrete path for `device`. Resolving before torch.compile keeps the forward's
    branch a plain string compare (no device query inside the traced code)."""
    if kernel != "auto":
        return kernel
    return "scaled_mm" if scaled_mm_supported(device) else "reference"


class Fp8Linear(nn.Module):
    """Drop-in for `nn.Linear` holding an e4m3 weight [N, K] and its fp32 per-channel scale [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, kernel: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, kernel: str = "auto") -> Fp8Linear:
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, kernel=kernel,
                  device=w.device, dtype=w.dtype)
        if not w.is_meta:
            q, scale = quantize_rowwise_fp8(w)
            mod.weight.copy_(q)
            mod.weight_scale.copy_(scale.squeeze(-1))
            if linear.bias is not None:
                mod.bias.data.copy_(linear.bias.detach())
        return mod

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        # One dynamic scale per token: computed on the fly (no calibration), so it stays correct for
        # any input and needs no host sync inside a CUDA graph.
        xq, x_scale = quantize_rowwise_fp8(x.reshape(-1, self.in_features))
        return self.matmul_quantized(xq, x_scale, x.dtype).reshape(*lead, self.out_features)

    def matmul_quantized(self, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype,
                         kernel: str | None = None) -> torch.Tensor:
        """The GEMM on an input already quantized (`quantize_rowwise_fp8` form): xq [M, K] e4m3, x_scale [M, 1].
        `kernel` overrides the module's own for this call (an engine's choice, leaving the shared module as is)."""
        resolved = resolve_kernel(kernel or self.kernel, xq.device)
        if resolved in ("triton", "scaled_mm_fast") and not xq.is_cuda:
            resolved = "reference"
        if resolved == "triton":
            out = fp8_gemm(xq, x_scale, self.weight, self.weight_scale)
            return (out if self.bias is None else out + self.bias.to(out.dtype)).to(out_dtype)
        if resolved in ("scaled_mm", "scaled_mm_fast"):
            return fp8_linear_scaled_mm(xq, x_scale, self.weight, self.weight_scale, self.bias, out_dtype,
                                        fast_accum=resolved == "scaled_mm_fast")
        return fp8_linear_reference(xq, x_scale, self.weight, self.weight_scale, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, kernel={self.kernel}"
