"""Per-pixel kernels for channels-last activations, seen as [pixels, channels] rows: the frame-0 VAE encode's norms,
residual adds and average shortcuts (`engine.vae_encode`), and the world decode's norms, residual adds and up blocks'
duplicating shortcuts (`engine.vae_decode`).

Why not Inductor's: the walk's `torch.compile(dynamic=True)` kernels (shared with the decoder's many shapes) ran these
memory-bound ops at 1.5-1.8 TB/s on the H200 (Wan2.2 encoder at the DROID canvas, 272x320 pixels x 160 channels: the
fused norm 91-104 us, the residual add 54 us, against ~16 and ~24 us at 3.5 TB/s), and PyTorch's own average shortcut
(pad, 8-D permute copy, mean) and downsampler pad were ~0.4 ms of copies for ~10 us of data
(bench/results/latency/2026-12-03-f584574-pace-ws0/, the traced E7 request). Here each op is one pass over its rows
with a fixed tile per channel count (no autotuning: a row's sums, and so its bits, never depend on the process).

Every kernel has an eager reference with the same math (fp32 inside, one rounding at the end), which is also what
runs where Triton cannot (CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_support import triton_device_problem

try:  # Triton ships with CUDA builds of torch; CPU-only installs (CI) have none and never run the kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

NORM_EPS = 1e-12  # F.normalize's floor on the norm, which diffusers' WanRMS_norm uses
_TILE_ELEMENTS = 4096  # rows x padded channels per program


def channels_last_problem(*tensors: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take these 4-D activations, or None: each must be channels-last and dense on a
    CUDA device with Triton."""
    problem = triton_device_problem(tensors[0].device)
    if problem:
        return problem
    for t in tensors:
        if t.dim() != 4 or not t.is_contiguous(memory_format=torch.channels_last):
            return f"not a dense channels-last 4-D tensor (shape {tuple(t.shape)}, strides {t.stride()})"
    return None


def _channels(v: torch.Tensor | None, c: int) -> torch.Tensor | None:
    """A per-channel fp32 vector ([C], [C, 1, 1], ...) as a contiguous [C]."""
    return None if v is None else v.reshape(c).float().contiguous()


def _tile(c: int) -> tuple[int, int, int]:
    block_c = triton.next_power_of_2(c)
    block_r = max(1, _TILE_ELEMENTS // block_c)
    return block_r, block_c, 8 if block_c >= 1024 else 4


# -- the norm ---------------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
                       shift: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, H, W] (+ shift per channel) divided by its L2 norm over the channels (floored at NORM_EPS), times
    weight, plus bias, then SiLU if `silu`; fp32 inside, rounded to x's dtype once. weight, bias, shift: fp32 per
    channel ([C, 1, 1]); bias may be a number."""
    c = x.shape[1]
    xf = x.float() if shift is None else x.float() + shift.reshape(c, 1, 1)
    w = weight.reshape(c, 1, 1)
    b = bias.reshape(c, 1, 1) if isinstance(bias, torch.Tensor) else bias
    y = xf / torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(NORM_EPS) * w + b
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
             shift: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm_reference` in one Triton kernel for a channels-last CUDA tensor (channels-last out); else the
    reference."""
    if channels_last_problem(x):
        return rms_norm_reference(x, weight, bias, silu, shift)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    _launch_norm(x, y, x.shape[1], weight, bias, silu, shift)
    return y


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | float, silu: bool,
                  shift: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same norm over the rows of a contiguous [rows, C] CUDA tensor (any activation whose memory is pixels x
    channels, seen as such: the VAE decoder's channels-last 3-D activations); `rows_problem` says when it cannot run.
    Per channel, weight, bias and shift may have any shape of C elements. `out`: a contiguous [rows, C] tensor of x's
    dtype to write into (a slice of a larger buffer), else a new one."""
    problem = rows_problem(x, *([out] if out is not None else []))
    if problem:
        raise ValueError(f"rms_norm_rows: {problem}")
    y = torch.empty_like(x) if out is None else out
    _launch_norm(x, y, x.shape[1], weight, bias, silu, shift)
    return y


def add_rows(x: torch.Tensor, shift: torch.Tensor, shortcut: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x + shift (fp32 per channel, any shape of C elements) [+ shortcut] over contiguous [rows, C] CUDA tensors, in
    fp32, rounded to x's dtype once (`add_reference`'s math); into `out` if given."""
    problem = rows_problem(x, *[t for t in (shortcut, out) if t is not None])
    if problem:
        raise ValueError(f"add_rows: {problem}")
    y = torch.empty_like(x) if out is None else out
    rows, c = x.shape
    block_r, block_c, warps = _tile(c)
    _add_kernel[(triton.cdiv(rows, block_r),)](
        x, shortcut if shortcut is not None else x, _channels(shift, c), y, rows, rows, 1, rows, 1, C=c,
        HAS_SHORTCUT=shortcut is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y


def rows_problem(x: torch.Tensor, *others: torch.Tensor) -> str | None:
    """Why the row kernels cannot take x (and `others`, which must match it), or None: each must be a contiguous
    [rows, channels] tensor of one shape and dtype on a CUDA device with Triton."""
    problem = triton_device_problem(x.device)
    if problem:
        return problem
    for t in (x, *others):
        if t.dim() != 2 or not t.is_contiguous():
            return f"not a contiguous [rows, channels] tensor (shape {tuple(t.shape)}, strides {t.stride()})"
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            return f"{tuple(t.shape)} {t.dtype} on {t.device} does not match {tuple(x.shape)} {x.dtype} on {x.device}"
    return None


def _launch_norm(x: torch.Tensor, y: torch.Tensor, c: int, weight: torch.Tensor, bias: torch.Tensor | float,
                 silu: bool, shift: torch.Tensor | None) -> None:
    rows = x.numel() // c  # pixels: the memory of x and y is [pixels, channels]
    bias_vec = _channels(bias, c) if isinstance(bias, torch.Tensor) else None
    w, s = _channels(weight, c), _channels(shift, c)
    block_r, block_c, warps = _tile(c)
    _norm_kernel[(triton.cdiv(rows, block_r),)](
        x, y, w, bias_vec if bias_vec is not None else w, s if s is not None else w, rows,
        0.0 if bias_vec is not None else float(bias), NORM_EPS, C=c, HAS_BIAS=bias_vec is not None,
        HAS_SHIFT=s is not None, SILU=silu, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


# -- the residual add (into a zero-padded grid) -------------------------------------------------------------------


def add_reference(x: torch.Tensor, shift: torch.Tensor, shortcut: torch.Tensor | None = None,
                  pad: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """x + shift (fp32 per channel) [+ shortcut], in fp32, rounded to x's dtype once; pad = (bottom rows, right
    columns) of zeros added after it (the downsampler's `ZeroPad2d((0, 1, 0, 1))` is (1, 1))."""
    y = x.float() + shift.reshape(-1, 1, 1)
    if shortcut is not None:
        y = y + shortcut.float()
    y = y.to(x.dtype)
    return F.pad(y, (0, pad[1], 0, pad[0])) if any(pad) else y


def add(x: torch.Tensor, shift: torch.Tensor, shortcut: torch.Tensor | None = None,
        pad: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """`add_reference` in one Triton kernel for channels-last CUDA tensors: the padded result is written straight
    into its place in a zeroed grid, with no separate pad copy. Else the reference."""
    if channels_last_problem(x, *([shortcut] if shortcut is not None else [])):
        return add_reference(x, shift, shortcut, pad).contiguous(memory_format=torch.channels_last)
    b, c, h, w = x.shape
    hp, wp = h + pad[0], w + pad[1]
    # allocated channels-last (`.contiguous(memory_format=...)` on a new tensor would be a copy of the whole grid)
    y = torch.empty((b, c, hp, wp), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if any(pad):
        y.zero_()
    rows = b * h * w
    block_r, block_c, warps = _tile(c)
    _add_kernel[(triton.cdiv(rows, block_r),)](
        x, shortcut if shortcut is not None else x, _channels(shift, c), y, rows, h, w, hp, wp, C=c,
        HAS_SHORTCUT=shortcut is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y


# -- the residual down block's average shortcut, added to the block's output ---------------------------------------


def avg_down_reference(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """diffusers' `AvgDown3D` on one frame [B, C, H, W] -> [B, out_channels, H/fs, W/fs] in x's dtype: the frame is
    the last of `factor_t` time slots (the ones before it are its zero padding), each output channel the mean of
    `group` consecutive entries of the (channel, time slot, row, column) axis."""
    b, c, h, w = x.shape
    fs = factor_s
    y = x.reshape(b, c, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 2, 4)  # [B, C, fs, fs, H', W']
    y = y.reshape(b, c, fs * fs, h // fs, w // fs)
    y = F.pad(y, (0, 0, 0, 0, (factor_t - 1) * fs * fs, 0))  # the zero time slots in front of the frame
    group = c * factor_t * fs * fs // out_channels
    return y.reshape(b, out_channels, group, h // fs, w // fs).float().mean(dim=2).to(x.dtype)


def avg_down_add_reference(x: torch.Tensor, shift: torch.Tensor, source: torch.Tensor, factor_t: int,
                           factor_s: int) -> torch.Tensor:
    """x + shift (fp32 per channel) + avg_down(source), in fp32, rounded to x's dtype once."""
    avg = avg_down_reference(source.float(), x.shape[1], factor_t, factor_s)
    return (x.float() + shift.reshape(-1, 1, 1) + avg).to(x.dtype)


def avg_down_add(x: torch.Tensor, shift: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int
                 ) -> torch.Tensor:
    """`avg_down_add_reference` in one Triton kernel for channels-last CUDA tensors, the shortcut gathered from
    `source` where it lies (diffusers pads, permutes into a copy and reduces it); else the reference."""
    b, c, h, w = x.shape
    cin = source.shape[1]
    if tuple(source.shape) != (b, cin, h * factor_s, w * factor_s) or (cin * factor_t * factor_s ** 2) % c:
        raise ValueError(f"average shortcut of {tuple(source.shape)} cannot give {tuple(x.shape)} at factors "
                         f"({factor_t}, {factor_s})")
    if channels_last_problem(x, source):
        return avg_down_add_reference(x, shift, source, factor_t, factor_s).contiguous(
            memory_format=torch.channels_last)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    rows = b * h * w
    block_r, block_c, warps = _tile(c)
    _avg_down_add_kernel[(triton.cdiv(rows, block_r),)](
        x, _channels(shift, c), source, y, rows, h, w, C=c, CIN=cin, GROUP=cin * factor_t * factor_s ** 2 // c,
        FT=factor_t, FS=factor_s, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y


# -- the decoder's up block: its duplicating shortcut, added to the block's output --------------------------------


def dup_up_reference(source: torch.Tensor, out_channels: int, factor_t: int, factor_s: int,
                     first_chunk: bool = False) -> torch.Tensor:
    """diffusers' `DupUp3D` [B, Cin, T, H, W] -> [B, out_channels, T*ft (less ft-1 on a first chunk), H*fs, W*fs], as
    a gather: output channel c at time phase it and spatial phases (ih, iw) reads source channel
    ((c*ft + it)*fs + ih)*fs + iw, divided by the repeat count; each output pixel reads the source pixel it grew
    from."""
    b, cin, t, h, w = source.shape
    ft, fs = factor_t, factor_s
    repeats = out_channels * ft * fs * fs // cin
    dev = source.device
    times = torch.arange(ft - 1 if first_chunk else 0, t * ft, device=dev)
    rows, cols = torch.arange(h * fs, device=dev), torch.arange(w * fs, device=dev)
    channel = torch.arange(out_channels, device=dev)[:, None, None, None]
    k = ((channel * ft + (times % ft)[:, None, None]) * fs + (rows % fs)[:, None]) * fs + cols % fs
    return source[:, k // repeats, (times // ft)[:, None, None], (rows // fs)[:, None], cols // fs]


def dup_up_add_reference(x: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int,
                         first_chunk: bool = False) -> torch.Tensor:
    """x + dup_up(source), in fp32, rounded to x's dtype once (what PyTorch's add of two bf16 tensors does)."""
    up = dup_up_reference(source, x.shape[1], factor_t, factor_s, first_chunk)
    return (x.float() + up.float()).to(x.dtype)


_DUP_UP_TILE = 64  # pixels and channels per program of the up-block kernel


def dup_up_add(x: torch.Tensor, source: torch.Tensor, factor_t: int, factor_s: int, first_chunk: bool = False
               ) -> torch.Tensor:
    """`dup_up_add_reference` in one Triton kernel on CUDA, written channels-last 3-D whatever x's layout (x and the
    source are read where they lie): diffusers repeats the source's channels into a copy, permutes that into a second
    copy, and adds it to x with a strided kernel (the layouts differ), and an upsampler's frame-major output stays
    frame-major for the convolutions and norms after it. Else the reference."""
    b, c, to, ho, wo = x.shape
    _, cin, t, h, w = source.shape
    skip = factor_t - 1 if first_chunk else 0
    if (source.shape[0], to + skip, ho, wo) != (b, t * factor_t, h * factor_s, w * factor_s) or (
            (c * factor_t * factor_s ** 2) % cin):
        raise ValueError(f"the up block's shortcut of {tuple(source.shape)} cannot give {tuple(x.shape)} at factors "
                         f"({factor_t}, {factor_s}), first_chunk={first_chunk}")
    if triton_device_problem(x.device) or source.device != x.device:
        return dup_up_add_reference(x, source, factor_t, factor_s, first_chunk).contiguous(
            memory_format=torch.channels_last_3d)
    y = torch.empty_like(x, memory_format=torch.channels_last_3d)
    rows = b * to * ho * wo
    # square tiles: each of x's layouts (channels-last, or frame-major from an upsampler) reads whole sectors along
    # one of the tile's two axes, and y is written along the channels
    _dup_up_add_kernel[(triton.cdiv(rows, _DUP_UP_TILE), triton.cdiv(c, _DUP_UP_TILE))](
        x, source, y, rows, to, ho, wo, skip, *(x.stride(d) for d in (0, 1, 2, 3, 4)),
        *(source.stride(d) for d in (0, 1, 2, 3, 4)), C=c, REPEATS=c * factor_t * factor_s ** 2 // cin, FT=factor_t,
        FS=factor_s, BLOCK_R=_DUP_UP_TILE, BLOCK_C=_DUP_UP_TILE, num_warps=4)
    return y

if triton is not None:

    @triton.jit
    def _norm_kernel(x_ptr, y_ptr, w_ptr, b_ptr, s_ptr, rows, bias_value, eps, C: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, SILU: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        cmask = c < C
        mask = (r[:, None] < rows) & cmask[None, :]
        offs = r[:, None].to(tl.int64) * C + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SHIFT:  # masked lanes stay 0: the shift loads 0 there too
            x = x + tl.load(s_ptr + c, mask=cmask, other=0.0)[None, :]
        norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
        y = x / norm[:, None] * tl.load(w_ptr + c, mask=cmask, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c, mask=cmask, other=0.0)[None, :]
        else:
            y = y + bias_value
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_kernel(x_ptr, s_ptr, shift_ptr, y_ptr, rows, H, W, HP, WP, C: tl.constexpr,
                    HAS_SHORTCUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        cmask = c < C
        mask = (r[:, None] < rows) & cmask[None, :]
        offs = r[:, None].to(tl.int64) * C + c[None, :]
        y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y + tl.load(shift_ptr + c, mask=cmask, other=0.0)[None, :]
        if HAS_SHORTCUT:
            y = y + tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # pixel (b, h, w) of the H x W grid -> its place in the HP x WP grid (the same row when nothing is padded)
        col = r % W
        line = r // W
        out = ((line // H) * HP + line % H).to(tl.int64) * WP + col
        tl.store(y_ptr + out[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _avg_down_add_kernel(x_ptr, shift_ptr, src_ptr, y_ptr, rows, H, W, C: tl.constexpr, CIN: tl.constexpr,
                             GROUP: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        o = tl.arange(0, BLOCK_C)
        omask = o < C
        mask = (r[:, None] < rows) & omask[None, :]
        offs = r[:, None].to(tl.int64) * C + o[None, :]
        col = r % W
        line = r // W
        # the top-left source pixel of each output pixel's FS x FS window
        corner = (((line // H) * (H * FS) + (line % H) * FS).to(tl.int64) * (W * FS) + col * FS)
        total = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(GROUP):
            q = o * GROUP + k  # this output channel's k-th entry of the (channel, slot, i, j) axis
            rest = q % (FT * FS * FS)
            real = (rest // (FS * FS)) == FT - 1  # the other time slots are the zero padding
            i = (rest % (FS * FS)) // FS
            j = rest % FS
            pix = corner[:, None] + (i * (W * FS) + j)[None, :]
            total += tl.load(src_ptr + pix * CIN + (q // (FT * FS * FS))[None, :],
                             mask=mask & (real & omask)[None, :], other=0.0).to(tl.float32)
        y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y + tl.load(shift_ptr + o, mask=omask, other=0.0)[None, :] + total / GROUP
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _dup_up_add_kernel(x_ptr, src_ptr, y_ptr, rows, TO, HO, WO, SKIP, xb, xc, xt, xh, xw, sb, sc, st, sh, sw,
                           C: tl.constexpr, REPEATS: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < C)
        # output pixel (b, time, row, col) in channels-last 3-D order, and the source pixel and phases it grew from
        col = r % WO
        rest = r // WO
        row = rest % HO
        rest = rest // HO
        frame = rest % TO
        b = rest // TO
        time = frame + SKIP
        phase = ((time % FT) * FS + row % FS) * FS + col % FS
        channel = (c[None, :] * (FT * FS * FS) + phase[:, None]) // REPEATS
        pixel = b.to(tl.int64) * sb + (time // FT).to(tl.int64) * st + (row // FS).to(tl.int64) * sh + (
            col // FS).to(tl.int64) * sw
        up = tl.load(src_ptr + pixel[:, None] + channel.to(tl.int64) * sc, mask=mask, other=0.0).to(tl.float32)
        at = b.to(tl.int64) * xb + frame.to(tl.int64) * xt + row.to(tl.int64) * xh + col.to(tl.int64) * xw
        y = tl.load(x_ptr + at[:, None] + c[None, :].to(tl.int64) * xc, mask=mask, other=0.0).to(tl.float32) + up
        tl.store(y_ptr + r[:, None].to(tl.int64) * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
