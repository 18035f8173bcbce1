"""The policy's frame-0 VAE encode as 2D convolutions: a third of the convolution work, no cache copies.

A policy request encodes one pixel frame (`pipeline.vae.FrameEncoder`). diffusers' Wan encoder runs it as a video:
every 3x3x3 causal convolution pads two zero frames in front of the one real frame, so two of the kernel's three
time taps multiply zeros, and before every convolution the residual blocks copy their input into the causal cache
(`feat_cache`), which a single frame never reads. On one frame each `WanCausalConv3d` (front padding =
kernel_t - 1, so only the last time tap meets data) is exactly a 2D convolution with that tap; the temporal
downsampler's time convolution never runs on a first chunk. This module walks diffusers' encoder modules and runs
that 2D computation with their weights (read only: the shared VAE is never modified, so a generation thread may use
the same encoder meanwhile), with the norm and the SiLU after it fused (`ops.channels_last.rms_norm`; with
`channels_last_kernels=False`, `vae_decode.rms_norm_silu`) and weights and
activations channels-last for cuDNN, and a residual block's convolution biases folded into its second norm and its
residual add (`fold_biases`: PyTorch adds a bias to a cuDNN convolution's output in a pass of its own).

With `capture=True` (CUDA) each input shape's walk is captured once into a CUDA graph and replayed: the walk is
~150 small kernels, and launching them one by one kept the GPU waiting on the host (H200, Edge E5: 9.3 ms for
the encode stage, of which ~3 ms convolutions). A policy request's graph starts from its uint8 canvas content
(`encode_content_uint8`: conversion, bucket pad and patchify inside), so the host neither pads nor converts.

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

from ..ops import channels_last
from ..ops.capture_turn import capture_turn_if_free, graph_capture
from ..pipeline.canvas import pad_unit_pixels
from ..pipeline.errors import RequestError
from ..pipeline.geometry import CanvasGeometry
from ..pipeline.vae import FrameEncoder, check_content, unit_pixels
from .graph_cache import ladder_rung
from .vae_decode import rms_norm_silu

log = logging.getLogger(__name__)


class UnsupportedEncoder(TypeError):
    """The encoder holds a module this 2D walk has no rule for."""


EXACT_ROWS = 8  # batches up to this many frames get a graph of their own size; larger ones the next power of two


def graph_rows(rows: int, ladder: tuple[int, ...] = ()) -> int:
    """The batch size a captured encode runs for `rows` frames: the smallest rung of `ladder` (the engine's batch
    ladder, whose top a server's memory plan counts) that holds them; past it, or without one, the same up to
    EXACT_ROWS, then the next power of two. Captured at every exact size, a grid's policy calls (batches of 1 to 128)
    kept capturing sizes the LRU had just evicted, each capture two eager walks on the request path; this bounds the
    graphs for batches up to 128 at 12 (the default `max_graphs`), at most doubling the frames of a batch above 8."""
    if (rung := ladder_rung(rows, ladder)) is not None:
        return rung
    return rows if rows <= EXACT_ROWS else 1 << (rows - 1).bit_length()


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [B, ...] with its first row repeated up to `rows` rows (the encode is per frame, so padding changes none)."""
    if rows <= x.shape[0]:
        return x
    return torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])


class FirstFrameEncoder(FrameEncoder):
    """A `FrameEncoder` whose `encode` of a single frame runs the 2D walk; anything else is diffusers' encode."""

    def __init__(self, frames: FrameEncoder, *, capture: bool = False, max_graphs: int = 12,
                 channel_multiple: int = 8, gemm_attention: bool = True, cudnn_benchmark: bool = False,
                 fold_biases: bool = True, channels_last_kernels: bool = True, row_ladder: tuple[int, ...] = ()
                 ) -> None:
        super().__init__(frames.vae)
        self.capture, self.max_graphs = capture, max_graphs
        self.row_ladder = row_ladder  # the engine's batch ladder: a captured encode pads a batch to its rung
        # A convolution whose input channels are not a multiple of this gets zero channels (and zero weights) up to
        # one: the patchified stem's 12 channels otherwise put cuDNN on a kernel without tensor cores (H200: 0.21 ms
        # of the ~3.9 ms encode). 0 or 1: off.
        self.channel_multiple = channel_multiple
        self.gemm_attention = gemm_attention  # False: the mid block's attention module itself (SDPA); see _attention
        # cuDNN times its algorithms per convolution shape on the first encode (warm-up, before capture) instead of
        # taking its heuristic's pick. Off by default: the pick can then differ from one process to the next, and
        # with it the latent's rounding (`wamrt bench vae --stages encode` measures what it would buy).
        self.cudnn_benchmark = cudnn_benchmark
        # A residual block's convolution biases folded into the ops after them (norm2, the residual add) instead of
        # PyTorch's separate bias pass after each cuDNN convolution: H200, the captured encode 3.304 -> 3.096 ms
        # (bench/results/latency/2026-12-03-57588cc-vae-fold-biases/).
        self.fold_biases = fold_biases
        # The norms, the residual adds (the downsamplers' zero pad written with them), the stem's bias and the down
        # blocks' average shortcuts (added with the downsampler's bias) in the kernels of ops/channels_last.py, one
        # pass each, instead of the compiled norm and add and PyTorch's pad / permute / mean copies. Off: those.
        # Where Triton cannot run (CPU) the same walk runs their eager references.
        self.channels_last_kernels = channels_last_kernels
        # (what, shapes, ...) -> (graph, static input, static output); LRU. One memory pool for all: replays are
        # serialised by _graph_lock and every output is copied out before the next replay.
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
        self._check_size(*pixels.shape[-2:])
        # The VAE's device and dtype as seen at construction: diffusers' `ModelMixin.dtype` walks every submodule
        # per access (~2.8 ms of host time per request at the Wan2.2 VAE, an idle GPU in the profile).
        x = pixels[:, :, 0].to(device=self.mean.device, dtype=self.mean.dtype)
        try:
            if self.capture and x.is_cuda:
                return self._graphed(("pixels", x.dtype, x.device), self._frame_latent, x)
            return self._frame_latent(x)
        except UnsupportedEncoder as e:
            self._give_up(e)
            return super().encode(pixels)

    @torch.inference_mode()
    def encode_content_uint8(self, content: torch.Tensor, geometry: CanvasGeometry) -> torch.Tensor:
        """As `FrameEncoder.encode_content_uint8`; captured, the graph starts from the uint8 content: conversion to
        [-1, 1], the bucket pad, patchify and the latent normalisation are in it (~10 fewer launches per request,
        and the host pads nothing)."""
        if not (self.capture and content.is_cuda) or self._unsupported:
            return super().encode_content_uint8(content, geometry)
        check_content(content, geometry)
        self._check_size(geometry.canvas_h, geometry.canvas_w)
        key = ("content", geometry, content.device)
        try:
            return self._graphed(key, lambda c: self._frame_latent(
                pad_unit_pixels(unit_pixels(c), geometry).to(self.mean.dtype)), content)
        except UnsupportedEncoder as e:
            self._give_up(e)
            return super().encode_content_uint8(content, geometry)

    def _check_size(self, h: int, w: int) -> None:
        if h % self.spatial or w % self.spatial:
            raise RequestError(f"VAE input size {h}x{w} must be a multiple of {self.spatial}")

    def _give_up(self, e: UnsupportedEncoder) -> None:
        self._unsupported = str(e)
        log.warning("first-frame VAE encode: %s; using diffusers' encode", e)

    def _frame_latent(self, x: torch.Tensor) -> torch.Tensor:
        """One frame [B, 3, H, W] in [-1, 1], the VAE's dtype -> the normalised latent, fp32 [B, z, 1, h, w]."""
        if self._patch is not None:
            x = patchify(x[:, :, None], patch_size=self._patch)[:, :, 0]
        x = x.contiguous(memory_format=torch.channels_last)
        if self.cudnn_benchmark:
            b = torch.backends.cudnn
            with b.flags(enabled=b.enabled, benchmark=True, benchmark_limit=b.benchmark_limit or 10,
                         deterministic=b.deterministic, allow_tf32=b.allow_tf32):
                mu = self._latent_mean(x)
        else:
            mu = self._latent_mean(x)
        return ((mu.unsqueeze(2) - self.mean) * self.inv_std).float()

    def _latent_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Patchified frame [B, C, H, W] -> the posterior mean [B, z, h, w] (latent_dist.mode())."""
        return self._conv(self.vae.quant_conv, self._encoder(x))[:, : self.latent_channels]

    def _graphed(self, key: tuple, fn, x: torch.Tensor) -> torch.Tensor:
        """fn(x), captured once per key and padded shape (`graph_rows`) into a CUDA graph and replayed; a copy of its
        first len(x) rows."""
        b = x.shape[0]
        x = pad_rows(x, graph_rows(b, self.row_ladder))
        key = (*key, tuple(x.shape))
        with self._graph_lock:
            entry = self._graphs.get(key)
            if entry is None:
                # On the request path: while another thread captures (the background ladder), this request runs
                # uncaptured rather than wait for it, and a later one captures (ops.capture_turn).
                with capture_turn_if_free() as free:
                    if not free:
                        return fn(x)[:b]
                    for _ in range(2):  # outside the capture: the fused norm's compile, cuDNN's algorithm choice
                        fn(x)
                    if self._pool is None:
                        self._pool = torch.cuda.graph_pool_handle()
                    static_in = x.clone()
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with graph_capture(graph, pool=self._pool):
                            static_out = fn(static_in)
                    except RuntimeError as e:  # never a failed request: the same walk, launched kernel by kernel
                        self.capture = False
                        log.warning("first-frame VAE encode: CUDA graph capture failed (%s); running it uncaptured", e)
                        return fn(x)[:b]
                entry = self._graphs[key] = (graph, static_in, static_out)
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            graph, static_in, static_out = entry
            static_in.copy_(x)
            graph.replay()
            return static_out[:b].clone()

    def encode_uint8(self, frames: torch.Tensor) -> torch.Tensor:
        """frames uint8 [B, H, W, 3] -> latent of each as a single frame, [B, C, 1, H/16, W/16]."""
        return self.encode(unit_pixels(frames)[:, :, None])

    # -- the walk: every activation is [B, C, H, W] (the single frame), channels-last -------------------------

    def _encoder(self, x: torch.Tensor) -> torch.Tensor:
        enc = self.vae.encoder
        if self.channels_last_kernels and enc.conv_in.bias is not None:  # PyTorch's bias pass is a slow broadcast
            x = channels_last.add(self._conv(enc.conv_in, x, bias=False), self._bias(enc.conv_in))
        else:
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
        if type(m) is WanResidualDownBlock and self.channels_last_kernels and self.fold_biases:
            return self._down_block(m, x)
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
            return self._attention(m, x) if self.gemm_attention else m(x.unsqueeze(2)).squeeze(2)
        raise UnsupportedEncoder(f"no first-frame rule for {type(m).__name__}"
                                 f"{' mode ' + m.mode if isinstance(m, WanResample) else ''}")

    def _down_block(self, m: WanResidualDownBlock, x: torch.Tensor) -> torch.Tensor:
        """A residual down block with its last residual add writing the downsampler's zero pad, the downsampler's
        convolution without bias, and its bias added with the average shortcut of the block's input in one pass."""
        resnets = list(m.resnets)
        source, conv = x, _padded_downsampler(m.downsampler) if resnets else None  # no add to write the pad: as is
        for index, resnet in enumerate(resnets):
            last = index == len(resnets) - 1
            x = self._residual(resnet, x, pad=(1, 1) if conv is not None and last else (0, 0))
        if conv is not None:
            x = F.conv2d(x, self._weight(conv), None, conv.stride, 0, conv.dilation, conv.groups)
            shift = self._bias(conv)
        elif m.downsampler is not None:
            x = self._block(m.downsampler, x)
            shift = None
        else:
            shift = None
        if shift is None:
            shift = self._cached(m, "zero shift", None, lambda _: x.new_zeros(x.shape[1], dtype=torch.float32))
        avg = m.avg_shortcut
        return channels_last.avg_down_add(x, shift, source, avg.factor_t, avg.factor_s)

    def _attention(self, m: WanAttentionBlock, x: torch.Tensor) -> torch.Tensor:
        """The block's single-head attention over the frame's pixels. Its head is as wide as the channels (640 at
        Wan2.2), past every flash kernel: SDPA ran the memory-efficient one at ~20 TFLOP/s (H200, 0.18 ms). Here
        two batched GEMMs, the scores in fp32 as a flash kernel keeps them; q/k/v are views of the channels-last
        to_qkv output, and the result comes back channels-last, so nothing is permuted in memory."""
        b, c, h, w = x.shape
        y = self._norm(m.norm, x, silu=False)
        qkv = F.conv2d(y, self._weight(m.to_qkv), m.to_qkv.bias)  # [B, 3C, H, W], channels-last
        q, k, v = qkv.permute(0, 2, 3, 1).reshape(b, h * w, 3 * c).split(c, dim=-1)  # [B, HW, C] views
        scores = _scores(q, k) * c**-0.5
        out = torch.bmm(scores.softmax(dim=-1).to(v.dtype), v)  # [B, HW, C]
        out = out.view(b, h, w, c).permute(0, 3, 1, 2)  # channels-last [B, C, H, W]
        return F.conv2d(out, self._weight(m.proj), m.proj.bias) + x

    def _residual(self, m: nn.Module, x: torch.Tensor, pad: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """A residual block; pad = (bottom rows, right columns) of zeros around its output (the downsampler's)."""
        if type(m) is not WanResidualBlock:
            raise UnsupportedEncoder(f"no first-frame rule for {type(m).__name__} in a residual position")
        silu = _is_silu(m.nonlinearity)
        if not self.fold_biases:
            shortcut = x if isinstance(m.conv_shortcut, nn.Identity) else self._conv(m.conv_shortcut, x)
            x = self._conv(m.conv1, self._norm(m.norm1, x, silu=silu))
            x = self._conv(m.conv2, m.dropout(self._norm(m.norm2, x, silu=silu)))
            return _pad(x + shortcut, pad)
        # conv1's bias goes into norm2, conv2's (and a shortcut convolution's) into the residual add
        shortcut = x if isinstance(m.conv_shortcut, nn.Identity) else self._conv(m.conv_shortcut, x, bias=False)
        x = self._conv(m.conv1, self._norm(m.norm1, x, silu=silu), bias=False)
        x = self._conv(m.conv2, m.dropout(self._norm(m.norm2, x, silu=silu, shift=self._bias(m.conv1))), bias=False)
        convs = (m.conv2,) if isinstance(m.conv_shortcut, nn.Identity) else (m.conv2, m.conv_shortcut)
        shift = self._cached(m, "residual shift", tuple(c.bias for c in convs), lambda _: _sum_biases(*convs))
        if self.channels_last_kernels:
            return channels_last.add(x, shift, shortcut, pad)
        return _pad(residual_add(x, shortcut, shift), pad)

    def _bias(self, m: nn.Module) -> torch.Tensor | None:
        """A convolution's bias as an fp32 [C, 1, 1] shift, or None."""
        if m.bias is None:
            return None
        return self._cached(m, "shift", m.bias, lambda b: b.detach().float().reshape(-1, 1, 1))

    def _norm(self, m: nn.Module, x: torch.Tensor, *, silu: bool, shift: torch.Tensor | None = None) -> torch.Tensor:
        if type(m) is not WanRMS_norm or not m.channel_first:
            raise UnsupportedEncoder(f"no first-frame rule for norm {type(m).__name__}")
        c = m.gamma.shape[0]
        weight = self._cached(m, "weight", m.gamma, lambda g: (g.detach().float() * m.scale).reshape(c, 1, 1))
        bias = m.bias
        if isinstance(bias, torch.Tensor):
            bias = self._cached(m, "bias", bias, lambda b: b.detach().float().reshape(c, 1, 1))
        if self.channels_last_kernels:
            return channels_last.rms_norm(x, weight, bias, silu, shift)
        return rms_norm_silu(x, weight, bias, silu, shift, kernel="compile")  # the walk before the Triton kernels

    def _conv(self, m: nn.Module, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
        """m's last time tap as a 2D convolution; bias=False leaves m's bias to the caller (folded into the next op:
        PyTorch adds a convolution's bias to its cuDNN output in a pass of its own)."""
        if type(m) is not WanCausalConv3d:
            raise UnsupportedEncoder(f"no first-frame rule for convolution {type(m).__name__}")
        w_pad, w_pad_r, h_pad, h_pad_b, front, back = m._padding
        kt, dt = m.kernel_size[0], m.dilation[0]
        if front != dt * (kt - 1) or back or w_pad != w_pad_r or h_pad != h_pad_b:
            raise UnsupportedEncoder(f"convolution with padding {m._padding} and time kernel {kt}: not one tap")
        tap = self._tap(m)
        if tap.shape[1] != x.shape[1]:  # zero channels added (channel_multiple)
            x = F.pad(x, (0, 0, 0, 0, 0, tap.shape[1] - x.shape[1])).contiguous(memory_format=torch.channels_last)
        return F.conv2d(x, tap, m.bias if bias else None, m.stride[1:], (h_pad, w_pad), m.dilation[1:], m.groups)

    def _tap(self, m: WanCausalConv3d) -> torch.Tensor:
        """The last time tap of m's kernel, channels-last, its input channels zero-padded to `channel_multiple`."""
        def make(w: torch.Tensor) -> torch.Tensor:
            tap = w.detach()[:, :, -1]
            extra = -tap.shape[1] % self.channel_multiple if self.channel_multiple > 1 and m.groups == 1 else 0
            return F.pad(tap, (0, 0, 0, 0, 0, extra)).contiguous(memory_format=torch.channels_last)

        return self._cached(m, "tap", m.weight, make)

    def _weight(self, m: nn.Conv2d) -> torch.Tensor:
        """A 2D convolution's weight, channels-last."""
        return self._cached(m, "weight", m.weight,
                            lambda w: w.detach().contiguous(memory_format=torch.channels_last))

    def _cached(self, m: nn.Module, what: str, source, make) -> torch.Tensor:
        """`make(source)`, made once per parameter tensor or tuple of them (again when one is replaced)."""
        with self._lock:
            entry = self._derived.get((id(m), what))
            if entry is None or not _same(entry[0], source):
                entry = self._derived[(id(m), what)] = (source, make(source))
            return entry[1]


def _padded_downsampler(m: nn.Module | None) -> nn.Conv2d | None:
    """The convolution of a downsampler that is diffusers' first-chunk `ZeroPad2d((0, 1, 0, 1))` + unpadded
    `Conv2d`, or None (no downsampler, or another form: the walk then runs it as it is)."""
    if type(m) is not WanResample or m.mode not in ("downsample2d", "downsample3d"):
        return None
    layers = list(m.resample)
    if (len(layers) == 2 and type(layers[0]) is nn.ZeroPad2d and tuple(layers[0].padding) == (0, 1, 0, 1)
            and type(layers[1]) is nn.Conv2d and tuple(layers[1].padding) == (0, 0)
            and layers[1].padding_mode == "zeros"):
        return layers[1]
    return None


def _pad(x: torch.Tensor, pad: tuple[int, int]) -> torch.Tensor:
    return F.pad(x, (0, pad[1], 0, pad[0])).contiguous(memory_format=torch.channels_last) if any(pad) else x


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T [B, HW, HW] in fp32. bf16 / fp16 on CUDA: tensor-core products summed in fp32 (`bmm`'s out_dtype), as a
    flash kernel computes them; upcasting the operands instead ran fp32 FMA (H200: 113 us of the ~3.1 ms encode)."""
    global _bmm_out_dtype
    if _bmm_out_dtype and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:  # a torch without it: upcast from now on
            _bmm_out_dtype = False
            log.warning("first-frame VAE encode: bmm with out_dtype unavailable (%s); upcasting the attention", e)
    return torch.bmm(q.float(), k.float().transpose(1, 2))


_bmm_out_dtype = True


def _same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


def _sum_biases(*convs: nn.Module) -> torch.Tensor:
    """The fp32 [C, 1, 1] sum of the convolutions' biases (zeros where none has one)."""
    total = torch.zeros(convs[0].out_channels, device=convs[0].weight.device)
    for c in convs:
        if c.bias is not None:
            total = total + c.bias.detach().float()
    return total.reshape(-1, 1, 1)


def _residual_add_eager(x: torch.Tensor, shortcut: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return (x.float() + shift + shortcut.float()).to(x.dtype)


_compiled_residual_add = None
_residual_add_failed = False


def residual_add(x: torch.Tensor, shortcut: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x + shift (per channel, fp32 [C, 1, 1]) + shortcut, computed in fp32 and rounded to x's dtype once: a residual
    block's output with its last convolution's bias folded in. On CUDA one compiled kernel (PyTorch adds a bias in a
    pass of its own after each cuDNN convolution: 35 of the encode's ~150 kernels at Wan2.2, ~0.49 ms on the H200,
    two in each residual block); elsewhere, or if the compile fails, eager."""
    global _compiled_residual_add, _residual_add_failed
    if not x.is_cuda or _residual_add_failed:
        return _residual_add_eager(x, shortcut, shift)
    if _compiled_residual_add is None:
        _compiled_residual_add = torch.compile(_residual_add_eager, dynamic=True, fullgraph=True)
    try:
        return _compiled_residual_add(x, shortcut, shift)
    except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure (Inductor's errors included)
        _residual_add_failed = True
        log.warning("torch.compile of the VAE encode's residual add failed; running it eagerly from now on: %s", e)
        return _residual_add_eager(x, shortcut, shift)


def _is_silu(m: nn.Module) -> bool:
    if isinstance(m, nn.SiLU):
        return True
    raise UnsupportedEncoder(f"no first-frame rule for nonlinearity {type(m).__name__}")
