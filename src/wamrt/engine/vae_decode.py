"""The Wan2.2 VAE decode with cheaper causal convolutions, swapped in for one decode only.

diffusers' `WanCausalConv3d` copies its whole input into a zero-padded tensor (`F.pad`, time and space) before
every convolution, and cuDNN converts that copy to channels-last and the output back. At 480x832x33 on the
H200 the decode took 731 ms, of which 377 ms were convolutions and 350 ms copies, layout conversions and
elementwise work (profile in bench/results/latency/2026-12-02-*-world/). Here the spatial padding is the
convolution's own (implicit zeros: no copy), time padding is copied only while the causal cache is short
(first frames), and the weights are kept channels-last, so cuDNN reads them as they are.

Same function, other kernels: results equal diffusers' decode up to float rounding (the CPU test compares in
fp32; in bf16 cuDNN's algorithm choice moves bits either way). The swap is a context manager on the decoder's
modules so the shared VAE stays diffusers' own outside our decode (the encoder is never touched).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d


class _ImplicitPadCausalConv3d(WanCausalConv3d):
    """`WanCausalConv3d.forward` without the padded copy (see the module docstring)."""

    _channels_last_weight: torch.Tensor

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        w_pad, _, h_pad, _, front, _ = self._padding
        if cache_x is not None and front > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            front -= cache_x.shape[2]
        if front > 0:
            x = F.pad(x, (0, 0, 0, 0, front, 0))
        return F.conv3d(x, self._channels_last_weight, self.bias, self.stride, (0, h_pad, w_pad), self.dilation,
                        self.groups)


_swap_lock = threading.Lock()  # one decode at a time swaps the classes (a second waits rather than un-swapping)


@contextmanager
def implicit_pad_decoder(vae: torch.nn.Module) -> Iterator[None]:
    """Within the block, `vae.decoder`'s causal convolutions run `_ImplicitPadCausalConv3d.forward`."""
    decoder = getattr(vae, "decoder", None)
    convs = [m for m in decoder.modules() if type(m) is WanCausalConv3d] if decoder is not None else []
    with _swap_lock:
        for m in convs:
            cached = m.__dict__.get("_channels_last_weight")
            if cached is None or cached.dtype != m.weight.dtype or cached.device != m.weight.device:
                # A channels-last copy made once (the decoder's weights are a few hundred MB in bf16).
                m.__dict__["_channels_last_weight"] = m.weight.detach().to(memory_format=torch.channels_last_3d)
            m.__class__ = _ImplicitPadCausalConv3d
        try:
            yield
        finally:
            for m in convs:
                m.__class__ = WanCausalConv3d
