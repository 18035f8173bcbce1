"""The policy's frame-0 VAE encode as 2D convolutions: a third of the convolution work, no cache copies.

A policy request encodes one pixel frame (`pipeline.vae.FrameEncoder`). diffusers' Wan encoder runs it as a video:
every 3x3x3 causal convolution pads two zero frames in front of the one real frame, so two of the kernel's three
time taps multiply zeros, and before every convolution the residual blocks copy their input into the causal cache
(`feat_cache`), which a single frame never reads. On one frame each `WanCausalConv3d` (front padding =
kernel_t - 1, so only the last time tap meets data) is exactly a 2D convolution with that tap; the temporal
downsampler's time convolution never runs on a first chunk. This module walks diffusers' encoder modules and runs
that 2D computation with their weights (read only: the shared VAE is never modified, so a generation thread may use
the same encoder meanwhile), with the norm and the SiLU after it fused (`vae_decode.rms_norm_silu`) and weights and
activations channels-last for cuDNN.

With `capture=True` (CUDA) each input shape's walk is captured once into a CUDA graph and replayed: the walk is
~150 small kernels, and launching them one by one kept the GPU waiting on the host (H200, Edge E5: 9.3 ms for
the encode stage, of which ~3 ms convolutions).

Same function, other kernels: equal to diffusers' encode up to float rounding (the CPU test compares in fp32).
An encoder with a module kind this walk does not know raises `UnsupportedEncoder`; `FirstFrameEncoder` then logs
once and uses diffusers' encode.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    WanAttentionBlock,
    WanCausalConv3d,
    WanResample,
    WanResidualBlock,
    WanResidualDownBlock,
    WanRMS_norm,
    patchify,
)
from torch import nn

from ..pipeline.errors import RequestError
from ..pipeline.vae import FrameEncoder
from .vae_decode import rms_norm_silu

log = logging.getLogger(__name__)


class UnsupportedEncoder(TypeError):
    """The encoder holds a module this 2D walk has no rule for."""


class FirstFrameEncoder(FrameEncoder):
    """A `FrameEncoder` whose `encode` of a single frame runs the 2D walk; anything else is diffusers' encode."""

    def __init__(self, frames: FrameEncoder, *, capture: bool = False, max_graphs: int = 8) -> None:
        super().__init__(frames.vae)
        self.capture, self.max_graphs = capture, max_graphs
        # input shape -> (graph, static input, static output); LRU. One memory pool for all: replays are serialised
        # by _graph_lock and every output is copied out before the next replay.
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._graph_lock = threading.Lock()
        self._pool = None
        self._patch = frames.vae.config.patch_size
        # (id(module), what) -> (the parameter it was made from, the derived tensor): conv taps, norm weights
        self._derived: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()  # the derived-tensor cache only; the walk itself shares nothing
        self._unsupported: str | None = None

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, T, H, W] in [-1, 1] -> fp32 [B, C, T', H/16, W/16], as `FrameEncoder.encode`."""
        if pixels.ndim != 5 or pixels.shape[1] != 3 or pixels.shape[2] != 1 or self._unsupported:
            return super().encode(pixels)
        h, w = pixels.shape[-2:]
        if h % self.spatial or w % self.spatial:
            raise RequestError(f"VAE input size {h}x{w} must be a multiple of {self.spatial}")
        # The VAE's device and dtype as seen at construction: diffusers' `ModelMixin.dtype` walks every submodule
        # per access (~2.8 ms of host time per request at the Wan2.2 VAE, an idle GPU in the profile).
        x = pixels.to(device=self.mean.device, dtype=self.mean.dtype)
        if self._patch is not None:
            x = patchify(x, patch_size=self._patch)
        x = x[:, :, 0].contiguous(memory_format=torch.channels_last)
        try:
            mu = self._graphed(x) if self.capture and x.is_cuda else self._latent_mean(x)
        except UnsupportedEncoder as e:
            self._unsupported = str(e)
            log.warning("first-frame VAE encode: %s; using diffusers' encode", e)
            return super().encode(pixels)
        return ((mu.unsqueeze(2) - self.mean) * self.inv_std).float()

    def _latent_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Patchified frame [B, C, H, W] -> the posterior mean [B, z, h, w] (latent_dist.mode())."""
        return self._conv(self.vae.quant_conv, self._encoder(x))[:, : self.latent_channels]

    def _graphed(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, x.device)
        with self._graph_lock:
            entry = self._graphs.get(key)
            if entry is None:
                for _ in range(2):  # outside the capture: the fused norm's compile, cuDNN's algorithm choice
                    self._latent_mean(x)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                static_in = x.clone(memory_format=torch.channels_last)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self._pool):
                        static_out = self._latent_mean(static_in)
                except RuntimeError as e:  # never a failed request: the same walk, launched kernel by kernel
                    self.capture = False
                    log.warning("first-frame VAE encode: CUDA graph capture failed (%s); running it uncaptured", e)
                    return self._latent_mean(x)
                entry = self._graphs[key] = (graph, static_in, static_out)
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            graph, static_in, static_out = entry
            static_in.copy_(x)
            graph.replay()
            return static_out.clone()

    def encode_uint8(self, frames: torch.Tensor) -> torch.Tensor:
        """frames uint8 [B, H, W, 3] -> latent of each as a single frame, [B, C, 1, H/16, W/16]."""
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise RequestError(f"expected uint8 [B, H, W, 3] frames, got {frames.dtype} {tuple(frames.shape)}")
        x = frames.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [B, 3, H, W]
        return self.encode(x[:, :, None])

    # -- the walk: every activation is [B, C, H, W] (the single frame), channels-last -------------------------

    def _encoder(self, x: torch.Tensor) -> torch.Tensor:
        enc = self.vae.encoder
        x = self._conv(enc.conv_in, x)
        for block in enc.down_blocks:
            x = self._block(block, x)
        mid = enc.mid_block
        x = self._residual(mid.resnets[0], x)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                x = self._block(attn, x)
            x = self._residual(resnet, x)
        x = self._norm(enc.norm_out, x, silu=_is_silu(enc.nonlinearity))
        return self._conv(enc.conv_out, x)

    def _block(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(m) is WanResidualBlock:
            return self._residual(m, x)
        if type(m) is WanResidualDownBlock:
            shortcut = m.avg_shortcut(x.unsqueeze(2)).squeeze(2)  # AvgDown3D on one frame (zero-pads time)
            for resnet in m.resnets:
                x = self._residual(resnet, x)
            if m.downsampler is not None:
                x = self._block(m.downsampler, x)
            return x + shortcut
        if type(m) is WanResample and m.mode in ("downsample2d", "downsample3d"):
            return m.resample(x)  # 2D already; a first chunk never runs the time convolution
        if type(m) is WanAttentionBlock:
            return m(x.unsqueeze(2)).squeeze(2)  # per-frame attention
        raise UnsupportedEncoder(f"no first-frame rule for {type(m).__name__}"
                                 f"{' mode ' + m.mode if isinstance(m, WanResample) else ''}")

    def _residual(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(m) is not WanResidualBlock:
            raise UnsupportedEncoder(f"no first-frame rule for {type(m).__name__} in a residual position")
        shortcut = x if isinstance(m.conv_shortcut, nn.Identity) else self._conv(m.conv_shortcut, x)
        silu = _is_silu(m.nonlinearity)
        x = self._conv(m.conv1, self._norm(m.norm1, x, silu=silu))
        x = self._conv(m.conv2, m.dropout(self._norm(m.norm2, x, silu=silu)))
        return x + shortcut

    def _norm(self, m: nn.Module, x: torch.Tensor, *, silu: bool) -> torch.Tensor:
        if type(m) is not WanRMS_norm or not m.channel_first:
            raise UnsupportedEncoder(f"no first-frame rule for norm {type(m).__name__}")
        c = m.gamma.shape[0]
        weight = self._cached(m, "weight", m.gamma, lambda g: (g.detach().float() * m.scale).reshape(c, 1, 1))
        bias = m.bias
        if isinstance(bias, torch.Tensor):
            bias = self._cached(m, "bias", bias, lambda b: b.detach().float().reshape(c, 1, 1))
        return rms_norm_silu(x, weight, bias, silu)

    def _conv(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if type(m) is not WanCausalConv3d:
            raise UnsupportedEncoder(f"no first-frame rule for convolution {type(m).__name__}")
        w_pad, w_pad_r, h_pad, h_pad_b, front, back = m._padding
        kt, dt = m.kernel_size[0], m.dilation[0]
        if front != dt * (kt - 1) or back or w_pad != w_pad_r or h_pad != h_pad_b:
            raise UnsupportedEncoder(f"convolution with padding {m._padding} and time kernel {kt}: not one tap")
        return F.conv2d(x, self._tap(m), m.bias, m.stride[1:], (h_pad, w_pad), m.dilation[1:], m.groups)

    def _tap(self, m: WanCausalConv3d) -> torch.Tensor:
        """The last time tap of m's kernel, channels-last."""
        return self._cached(m, "tap", m.weight,
                            lambda w: w.detach()[:, :, -1].contiguous(memory_format=torch.channels_last))

    def _cached(self, m: nn.Module, what: str, source: torch.Tensor, make) -> torch.Tensor:
        """`make(source)`, made once per parameter tensor (again when the module's parameter is replaced)."""
        with self._lock:
            entry = self._derived.get((id(m), what))
            if entry is None or entry[0] is not source:
                entry = self._derived[(id(m), what)] = (source, make(source))
            return entry[1]


def _is_silu(m: nn.Module) -> bool:
    if isinstance(m, nn.SiLU):
        return True
    raise UnsupportedEncoder(f"no first-frame rule for nonlinearity {type(m).__name__}")
