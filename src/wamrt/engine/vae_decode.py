"""The Wan2.2 VAE decode with cheaper causal convolutions and fused norms, swapped in for one decode only.

diffusers' `WanCausalConv3d` copies its whole input into a zero-padded tensor (`F.pad`, time and space) before
every convolution, and cuDNN converts that copy to channels-last and the output back. At 480x832x33 on the
H200 the decode took 731 ms, of which 377 ms were convolutions and 350 ms copies, layout conversions and
elementwise work (profile in bench/results/latency/2026-12-02-*-world/). Three swaps cut the second part:

* Convolutions: the spatial padding is the convolution's own (implicit zeros: no copy), time padding is copied
  only while the causal cache is short (first frames), and the weights are kept channels-last, so cuDNN reads
  them as they are.
* Norms (`fuse_norms=True`, the default): diffusers' `WanRMS_norm` makes about seven passes over an activation
  (upcast copy, norm reduction, divide, downcast, times scale, times gamma, plus a bias of 0.0) and the SiLU that
  follows it in `WanResidualBlock` and at the decoder's head is one more. `rms_norm_silu` computes all of it from
  one read and one write, and the parent's `nonlinearity` becomes `nn.Identity()` while the SiLU lives in the norm.
  On CUDA the kernel is, by `norm_kernel`: "rows" (the default), `ops.channels_last`'s Triton row kernel wherever
  the activation's memory is [pixels, channels] (the channels-last convolutions' outputs; with `fuse_blocks`, all
  261 norm calls of an i2v decode), else the compiled one; "compile", a `torch.compile(dynamic=True)` kernel for
  every layout. Elsewhere the same math runs eagerly. Why a hand-written kernel: Inductor's dynamic-shape reduction
  ran the encoder's norms at 1.5-1.8 TB/s on the H200 against ~3.5 for the row kernel (`ops/channels_last.py`).
* Blocks (`fuse_blocks=True`, the default, with the fused norms): in each residual block the convolution biases
  ride in the ops after them (PyTorch adds a cuDNN convolution's bias in a broadcast pass of its own) and each
  causal convolution's input is assembled in place instead of concatenated (`_FusedResidualBlock`); each residual
  up block adds its duplicating shortcut in one gather kernel, without the input clone and the two copies diffusers
  makes for it (`_FusedResidualUpBlock`).

Same function, other kernels: results equal diffusers' decode up to float rounding (the CPU test compares in
fp32; in bf16 cuDNN's algorithm choice moves bits either way, and the fused norm rounds to bf16 once instead of
after every step). The swap is a context manager on the decoder's modules so the shared VAE stays diffusers' own
outside our decode (the encoder is never touched).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    CACHE_T,
    DupUp3D,
    WanCausalConv3d,
    WanDecoder3d,
    WanResidualBlock,
    WanResidualUpBlock,
    WanRMS_norm,
)
from torch import nn

from ..ops import channels_last

log = logging.getLogger(__name__)

RMS_NORM_EPS = 1e-12  # F.normalize's default, which diffusers' WanRMS_norm uses


class _ImplicitPadCausalConv3d(WanCausalConv3d):
    """`WanCausalConv3d.forward` without the padded copy (see the module docstring)."""

    _channels_last_weight: torch.Tensor

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        front = self._padding[4]
        if cache_x is not None and front > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            front -= cache_x.shape[2]
        if front > 0:
            x = F.pad(x, (0, 0, 0, 0, front, 0))
        return self.conv(x)

    def conv(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The convolution of an input whose causal frames are already in front; bias=False leaves the bias to the
        caller (`_FusedResidualBlock` folds it into the op after)."""
        w_pad, _, h_pad, _, _, _ = self._padding
        return F.conv3d(x, self._channels_last_weight, self.bias if bias else None, self.stride, (0, h_pad, w_pad),
                        self.dilation, self.groups)


# ---------------------------------------------------------------------------------------------------------------
# Fused RMS norm (+ SiLU)


def _rms_norm_silu_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
                         shift: torch.Tensor | None = None) -> torch.Tensor:
    # Elementwise ops and a keepdim reduction only: the output keeps x's memory format (channels-last activations
    # from the channels-last convolutions stay channels-last, with no layout conversion before the next conv).
    xf = x.float() if shift is None else x.float() + shift
    y = xf / torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(RMS_NORM_EPS) * weight + bias
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


def _on_dense_rows(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fn(x, weight, bias, silu)` computed on x's memory seen as a contiguous [outer, C, inner] view (no copy), the
    result viewed back in x's shape and memory format. The compiled kernel then sees at most a handful of kinds of
    input (outer and inner one or more) instead of one per rank, frame count and layout (channels-last, contiguous,
    the upsampler's frame-major output, ...), each of which would cost a recompile and could run into Dynamo's
    recompile limit. An input with no such view (gaps, broadcast dims) goes to `fn` as it is."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost dim first; stable for size-1 ties
    dense = x.permute(order)
    if not dense.is_contiguous():
        return fn(x, weight, bias, silu, shift)
    at = order.index(1)
    channels = x.shape[1]
    rows = dense.view(math.prod(dense.shape[:at]), channels, math.prod(dense.shape[at + 1 :]))
    if isinstance(bias, torch.Tensor):
        bias = bias.reshape(channels, 1)
    if shift is not None:
        shift = shift.reshape(channels, 1)
    y = fn(rows, weight.reshape(channels, 1), bias, silu, shift)
    return y.view(dense.shape).permute(sorted(range(x.dim()), key=order.__getitem__))


_compiled_rms_norm_silu: Callable[..., torch.Tensor] | None = None
_compile_failed = False  # set once torch.compile has raised: eager from then on (warned once)
_recompile_limit_warned = False
COMPILED_DEVICE_TYPES = ("cuda",)  # elsewhere eager (CPU CI compares with diffusers in fp32)
# Raised instead of compiling a new kind of input once Dynamo's recompile limit is reached (fullgraph=True); older
# torch raises an `Unsupported` there, which the compile-failure branch takes.
_RECOMPILE_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


NORM_KERNELS = ("rows", "compile")


def _triton_rows_or_compiled(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
                             shift: torch.Tensor | None = None) -> torch.Tensor:
    """On an [outer, C, inner] view: the Triton row kernel when inner is 1 (memory [pixels, C]), else compiled."""
    flat = rows.view(rows.shape[0], rows.shape[1]) if rows.shape[2] == 1 else None
    if flat is not None and channels_last.rows_problem(flat) is None:
        return channels_last.rms_norm_rows(flat, weight, bias, silu, shift).view(rows.shape)
    return _compiled(rows, weight, bias, silu, shift)


def _compiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
              shift: torch.Tensor | None = None) -> torch.Tensor:
    global _compiled_rms_norm_silu
    if _compiled_rms_norm_silu is None:
        _compiled_rms_norm_silu = torch.compile(_rms_norm_silu_eager, dynamic=True, fullgraph=True)
    return _compiled_rms_norm_silu(x, weight, bias, silu, shift)


def rms_norm_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
                  shift: torch.Tensor | None = None, kernel: str = "rows") -> torch.Tensor:
    """`x / max(||x||_2 over dim 1, 1e-12) * weight + bias`, then SiLU if `silu`, computed in fp32 and rounded to
    x's dtype once; `weight` is diffusers' `scale * gamma` in fp32, shaped like gamma ([C, 1, ...]). `shift` (fp32,
    shaped like weight) is added to x first: the bias of the convolution before, which then costs no pass. On CUDA one
    kernel, one read and one write of x where diffusers' norm and SiLU make about eight passes: with
    `kernel="rows"` the Triton row kernel where x's memory is [pixels, C], the compiled one for other layouts; with
    "compile" the compiled one always. `dynamic=True` and the [outer, C, inner] view (`_on_dense_rows`) let the
    decoder's many shapes share a few compiled graphs; `silu` is a Python bool, so it specialises them."""
    global _compile_failed, _recompile_limit_warned
    if kernel not in NORM_KERNELS:
        raise ValueError(f"kernel must be one of {NORM_KERNELS}, got {kernel!r}")
    if x.device.type not in COMPILED_DEVICE_TYPES or _compile_failed:
        return _rms_norm_silu_eager(x, weight, bias, silu, shift)
    try:
        return _on_dense_rows(_triton_rows_or_compiled if kernel == "rows" else _compiled, x, weight, bias, silu,
                              shift)
    except _RECOMPILE_LIMIT_HIT as e:  # e.g. decodes in several dtypes: the kinds compiled so far stay compiled
        if not _recompile_limit_warned:
            _recompile_limit_warned = True
            log.warning(
                "VAE fused RMS norm: Dynamo's recompile limit reached; new kinds of input (here %s %s, "
                "strides %s) run eagerly: %s",
                x.dtype,
                tuple(x.shape),
                x.stride(),
                e,
            )
        return _rms_norm_silu_eager(x, weight, bias, silu, shift)
    except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure (Inductor's errors included), not OOM
        _compile_failed = True
        log.warning("torch.compile of the VAE's fused RMS norm failed; running it eagerly from now on: %s", e)
        return _rms_norm_silu_eager(x, weight, bias, silu, shift)


class _FusedRMSNorm(WanRMS_norm):
    """`WanRMS_norm` (+ the parent's SiLU when `_fused_silu`) as one `rms_norm_silu` call."""

    _fused_weight: torch.Tensor
    _fused_bias: torch.Tensor | float
    _fused_silu: bool
    _fused_kernel: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_silu(x, self._fused_weight, self._fused_bias, self._fused_silu, kernel=self._fused_kernel)


# Every use of `self.nonlinearity` in these diffusers classes' forward comes directly after one of these norms
# (WanResidualBlock: norm1 -> SiLU, norm2 -> SiLU, then dropout; WanDecoder3d: norm_out -> SiLU; diffusers 0.42.1),
# so with the SiLU inside those norms the parent's own becomes an identity. Other blocks with a `nonlinearity`
# (the encoder's) are never touched; the attention block's norm gets no SiLU.
_NORMS_BEFORE_NONLINEARITY: dict[type[nn.Module], tuple[str, ...]] = {
    WanResidualBlock: ("norm1", "norm2"),
    WanDecoder3d: ("norm_out",),
}
_FUSED_ATTRS = ("_fused_weight", "_fused_bias", "_fused_silu", "_fused_kernel")


def _swap_norms(decoder: nn.Module, stack: ExitStack, kernel: str = "rows") -> None:
    """Makes `decoder`'s norms `_FusedRMSNorm`s (with their parent's SiLU where it follows them); `stack` undoes it."""
    norms = [m for m in decoder.modules() if type(m) is WanRMS_norm and m.channel_first]
    silu_norms: set[int] = set()
    for parent in list(decoder.modules()):
        names = _NORMS_BEFORE_NONLINEARITY.get(type(parent))
        if names is None or type(getattr(parent, "nonlinearity", None)) is not nn.SiLU:
            continue
        followed = [getattr(parent, n, None) for n in names]
        if not all(type(n) is WanRMS_norm and n.channel_first for n in followed):
            continue  # the SiLU stays where it is unless every norm before it takes it over
        silu_norms.update(id(n) for n in followed)
        saved = parent.nonlinearity
        parent.nonlinearity = nn.Identity()
        stack.callback(setattr, parent, "nonlinearity", saved)
    for m in norms:
        # Made on every entry (C floats each), so weights loaded between decodes are never stale.
        bias = m.bias.detach().float() if isinstance(m.bias, torch.Tensor) else m.bias
        m.__dict__.update(
            _fused_weight=m.gamma.detach().float() * m.scale, _fused_bias=bias, _fused_silu=id(m) in silu_norms,
            _fused_kernel=kernel,
        )
        m.__class__ = _FusedRMSNorm
        stack.callback(_unfuse_norm, m)


def _unfuse_norm(m: nn.Module) -> None:
    m.__class__ = WanRMS_norm
    for attr in _FUSED_ATTRS:
        m.__dict__.pop(attr, None)


def _swap_convs(decoder: nn.Module, stack: ExitStack) -> None:
    for m in [m for m in decoder.modules() if type(m) is WanCausalConv3d]:
        cached = m.__dict__.get("_channels_last_weight")
        if cached is None or cached.dtype != m.weight.dtype or cached.device != m.weight.device:
            # A channels-last copy made once (the decoder's weights are a few hundred MB in bf16).
            m.__dict__["_channels_last_weight"] = m.weight.detach().to(memory_format=torch.channels_last_3d)
        m.__class__ = _ImplicitPadCausalConv3d
        stack.callback(setattr, m, "__class__", WanCausalConv3d)


# ---------------------------------------------------------------------------------------------------------------
# The residual block: convolution biases folded, each causal convolution's input assembled in place


def _pixel_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x's memory as a contiguous [pixels, C] view when x is a channels-last 3-D tensor of batch 1 (so that a range
    of its frames is a range of rows too: a slice of a buffer along time), else None."""
    if x.dim() != 5 or x.shape[0] != 1 or not x.is_contiguous(memory_format=torch.channels_last_3d):
        return None
    return x.permute(0, 2, 3, 4, 1).view(-1, x.shape[1])


def _norm_into(norm: _FusedRMSNorm, x: torch.Tensor, out: torch.Tensor, shift: torch.Tensor | None) -> None:
    """`norm` (its SiLU included) of x + shift, written into `out` (a slice of a convolution's input buffer): by the
    row kernel straight into place where both are pixel rows on CUDA, else computed and copied."""
    w, b, silu = norm._fused_weight, norm._fused_bias, norm._fused_silu
    if x.device.type in COMPILED_DEVICE_TYPES and norm._fused_kernel == "rows":
        src, dst = _pixel_rows(x), _pixel_rows(out)
        if src is not None and dst is not None and channels_last.rows_problem(src, dst) is None:
            channels_last.rms_norm_rows(src, w, b, silu, shift, out=dst)
            return
    out.copy_(rms_norm_silu(x, w, b, silu, shift, kernel=norm._fused_kernel))


def _residual_add(x: torch.Tensor, shift: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x + shift (fp32 per channel) + h, in fp32, rounded to x's dtype once: one row kernel on CUDA (h brought to
    x's layout first if it has another), else eagerly."""
    rows = _pixel_rows(x)
    if x.device.type in COMPILED_DEVICE_TYPES and rows is not None:
        h_rows = _pixel_rows(h)
        if h_rows is None:
            h_rows = _pixel_rows(h.contiguous(memory_format=torch.channels_last_3d))
        if h_rows is not None and channels_last.rows_problem(rows, h_rows) is None:
            b, c, t, hh, ww = x.shape
            return channels_last.add_rows(rows, shift, h_rows).view(b, t, hh, ww, c).permute(0, 4, 1, 2, 3)
    return (x.float() + shift + h.float()).to(x.dtype)


class _FusedResidualBlock(WanResidualBlock):
    """`WanResidualBlock.forward` with fewer passes over its activations, the same function:
    * PyTorch adds a cuDNN convolution's bias in a pass of its own (a broadcast add, at ~10 % of the decode): here
      conv1's bias is the `shift` of norm2, and conv2's and the shortcut convolution's are added in the residual add,
      which is one row kernel (x + bias + shortcut, rounded once);
    * diffusers (and `_ImplicitPadCausalConv3d`) concatenate each 3x3x3 convolution's cached frames (or zeros) with
      its input into a new tensor: here the buffer is made first, the cached frames copied to its front and the norm
      writing its output behind them.
    The causal cache holds what diffusers' holds (the norm output's last CACHE_T frames, the previous chunk's last
    frame in front of a one-frame chunk). Needs the decoder's norms and convolutions swapped (`_swap_norms`,
    `_swap_convs`); made by `_swap_blocks` only where they are."""

    _fused_shift1: torch.Tensor  # conv1's bias, fp32 [C, 1, 1, 1]: norm2's shift
    _fused_shift2: torch.Tensor  # conv2's bias plus the shortcut convolution's, fp32 [C, 1, 1, 1]

    def forward(self, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]  # noqa: B006
                ) -> torch.Tensor:  # diffusers' signature: the decoder passes a shared counter list
        shortcut = self.conv_shortcut
        h = x if isinstance(shortcut, nn.Identity) else shortcut.conv(x, bias=False)
        x = self._norm_then_conv(self.norm1, self.conv1, x, None, feat_cache, feat_idx)
        x = self._norm_then_conv(self.norm2, self.conv2, x, self._fused_shift1, feat_cache, feat_idx)
        return _residual_add(x, self._fused_shift2, h)

    @staticmethod
    def _norm_then_conv(norm: _FusedRMSNorm, conv: _ImplicitPadCausalConv3d, x: torch.Tensor,
                        shift: torch.Tensor | None, feat_cache: list | None, feat_idx: list[int]) -> torch.Tensor:
        front = conv._padding[4]  # the causal frames in front of the input: cached ones, zeros for the rest
        previous = feat_cache[feat_idx[0]] if feat_cache is not None else None
        cached = previous.shape[2] if previous is not None else 0
        b, c, t, hh, ww = x.shape
        buffer = torch.empty((b, c, front + t, hh, ww), dtype=x.dtype, device=x.device,
                             memory_format=torch.channels_last_3d)
        if front > cached:
            buffer[:, :, : front - cached].zero_()
        if cached:
            buffer[:, :, front - cached : front].copy_(previous)
        normed = buffer[:, :, front:]
        _norm_into(norm, x, normed, shift)
        if feat_cache is not None:
            if t >= CACHE_T or previous is None:
                feat_cache[feat_idx[0]] = normed[:, :, -CACHE_T:].clone()
            else:  # a one-frame chunk: the previous chunk's last frame goes in front (diffusers' rule)
                feat_cache[feat_idx[0]] = torch.cat([previous[:, :, -1:], normed], dim=2)
            feat_idx[0] += 1
        return conv.conv(buffer, bias=False)


class _FusedResidualUpBlock(WanResidualUpBlock):
    """`WanResidualUpBlock.forward` without its two full copies for the shortcut: diffusers clones the block's input
    (nothing here writes into it) and builds `DupUp3D`'s output in two copies (a channel repeat, then a permute),
    which it adds to the block's output with a strided kernel (the layouts differ); here one kernel reads the source
    pixels where they lie and adds them (`ops.channels_last.dup_up_add`; bit for bit the same sum)."""

    def forward(self, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0],  # noqa: B006
                first_chunk: bool = False) -> torch.Tensor:  # diffusers' signature (a shared counter list)
        source = x
        for resnet in self.resnets:
            x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
        if self.upsampler is not None:
            x = self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx)
        if self.avg_shortcut is not None:
            up = self.avg_shortcut
            x = channels_last.dup_up_add(x, source, up.factor_t, up.factor_s, first_chunk)
        return x


def _swap_blocks(decoder: nn.Module, stack: ExitStack) -> None:
    """Makes `decoder`'s residual blocks `_FusedResidualBlock`s where their norms and convolutions are swapped (and no
    dropout is active), and its residual up blocks `_FusedResidualUpBlock`s; `stack` undoes it."""
    for m in [m for m in decoder.modules() if type(m) is WanResidualUpBlock]:
        if m.avg_shortcut is None or type(m.avg_shortcut) is DupUp3D:
            m.__class__ = _FusedResidualUpBlock
            stack.callback(setattr, m, "__class__", WanResidualUpBlock)
    for m in [m for m in decoder.modules() if type(m) is WanResidualBlock]:
        norms_fused = all(type(n) is _FusedRMSNorm and n._fused_silu for n in (m.norm1, m.norm2))
        convs = (m.conv1, m.conv2)
        shortcut = m.conv_shortcut
        if not norms_fused or not all(type(v) is _ImplicitPadCausalConv3d for v in convs):
            continue
        if not (isinstance(shortcut, nn.Identity) or (type(shortcut) is _ImplicitPadCausalConv3d
                                                      and shortcut._padding == (0,) * 6)):
            continue
        if m.training and m.dropout.p > 0:
            continue
        channels = m.conv2.out_channels

        def bias(conv: nn.Module) -> torch.Tensor:
            if not isinstance(conv, nn.Conv3d) or conv.bias is None:
                return torch.zeros(channels, 1, 1, 1, device=m.conv2.weight.device)
            return conv.bias.detach().float().reshape(-1, 1, 1, 1)

        # Made on every entry (C floats each), so weights loaded between decodes are never stale.
        m.__dict__.update(_fused_shift1=bias(m.conv1), _fused_shift2=bias(m.conv2) + bias(shortcut))
        m.__class__ = _FusedResidualBlock
        stack.callback(_unfuse_block, m)


def _unfuse_block(m: nn.Module) -> None:
    m.__class__ = WanResidualBlock
    for attr in ("_fused_shift1", "_fused_shift2"):
        m.__dict__.pop(attr, None)


_swap_lock = threading.Lock()  # one decode at a time swaps the classes (a second waits rather than un-swapping)


@contextmanager
def implicit_pad_decoder(vae: torch.nn.Module, fuse_norms: bool = True, norm_kernel: str = "rows",
                         fuse_blocks: bool = True) -> Iterator[None]:
    """Within the block, `vae.decoder`'s causal convolutions run `_ImplicitPadCausalConv3d.forward` and, with
    `fuse_norms`, its RMS norms (and the SiLUs after them) run `rms_norm_silu` with `norm_kernel` ("rows" or
    "compile", see the module docstring), and with `fuse_blocks` too, its residual blocks run
    `_FusedResidualBlock.forward` (biases folded, inputs assembled in place) and its residual up blocks
    `_FusedResidualUpBlock.forward` (the shortcut gathered in its add); all is diffusers' own again after. Not
    reentrant: a nested block on any VAE waits for ever on the lock."""
    if norm_kernel not in NORM_KERNELS:
        raise ValueError(f"norm_kernel must be one of {NORM_KERNELS}, got {norm_kernel!r}")
    decoder = getattr(vae, "decoder", None)
    with _swap_lock, ExitStack() as undo:  # undo runs first (last in, first out), also when the body raises
        if decoder is not None:
            _swap_convs(decoder, undo)
            if fuse_norms:
                _swap_norms(decoder, undo, norm_kernel)
                if fuse_blocks:
                    _swap_blocks(decoder, undo)
        yield
