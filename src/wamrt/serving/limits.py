"""Every per-request bound of the server, from one place (docs/serving.md, "Limits").

A request is bounded before anything is allocated for it: bytes (`body.py`, as the body streams), structure
(`loads_json`, `unpack_msgpack`: nesting depth and values counted before or while parsing), decoded size
(`open_image`: pixels read from the image header before decoding; `decode_video` in dynamics.py: frames x
pixels from the stream header), prompt tokens (`check_prompt`, every surface, counted by the served
tokenizer after a byte pre-bound), sampler ranges (`SAMPLER_RANGES`) and, for world generation, the time of
one denoising step and of the whole job (`GenerationCost`, a FLOP model of the served checkpoint against a
measured device rate). Each violation is a typed `InvalidRequest` / `PayloadTooLarge` naming the field.

All of it runs in the parse pool (`Service.offload`), never on the event loop.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client.wire import WireError, decode_hook, decode_image
from .errors import InvalidRequest, PayloadTooLarge

# A prompt longer than this many UTF-8 bytes per allowed token is refused without tokenizing it (BPE tokens
# of real text average 3-5 bytes; 16 leaves room for long runs of one character). At or under one byte per
# token it passes without tokenizing: a byte-level BPE never makes more tokens than bytes.
MAX_BYTES_PER_TOKEN = 16
# Sane ranges of the sampler fields every surface accepts (inclusive). Guidance beyond ~20 already saturates
# the image; 100 leaves room. Shift is a flow-matching time warp, ~1-20 in practice. Steps of a world job are
# bounded again by its cost (`GenerationCost`), policy steps by `--max-policy-steps`.
SAMPLER_RANGES: dict[str, tuple[float, float]] = {
    "guidance": (0.0, 100.0),
    "shift": (1e-3, 1e3),
    "guidance_interval": (0, 10_000),  # timestep units (the schedule's 1000 + 1)
    "generation_steps": (1, 1000),
    "fps": (1.0, 240.0),  # what the MP4 muxer writes as given (Fraction with a denominator <= 1001)
}
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (unrolled: no backtracking per character)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class Limits:
    """The bounds one request is held to (`ServeConfig.limits()`; defaults are `wamrt serve`'s)."""

    body_bytes: int = 64 * 2**20  # --max-frame-mb: one HTTP body or websocket frame
    body_timeout_s: float = 60.0  # --body-timeout-s: the whole body must arrive within this
    json_depth: int = 32  # nesting of arrays / objects in one JSON document (an observation needs 5)
    # Values (numbers, strings, containers) in one JSON or msgpack document. The sample observation as nested
    # JSON lists is 1.4 M; raw bytes (`b64`, msgpack ndarrays) count one each.
    elements: int = 2**21
    # Values in one msgpack message: arrays travel as bytes there (openpi / msgpack-numpy / vLLM markers), so an
    # observation holds ~100 values; this bound costs at most ~30 ms of parsing (each map is a Python call).
    msgpack_elements: int = 2**16
    image_pixels: int = 3840 * 2160  # --max-image-pixels: one decoded picture (a view, a conditioning frame)
    decoded_pixels: int = 2**26  # frames x pixels decoded from one uploaded video (~200 MB of RGB)
    instruction_tokens: int = 384  # --max-prompt-tokens: a policy instruction's own tokens
    prompt_tokens: int = 1024  # --max-generation-prompt-tokens: a generation prompt's, chat template included
    policy_steps: int = 1000  # --max-policy-steps (resolved against the checkpoint's default steps)


DEFAULT_LIMITS = Limits()


# --- structure ----------------------------------------------------------------------------------------

def loads_json(data: bytes | str, *, field: str | None = None, limits: Limits = DEFAULT_LIMITS) -> Any:
    """JSON with its size, value count and nesting depth bounded before `json.loads` allocates anything.

    The count is an upper bound read at C speed (commas and openings); the depth is read from the brackets
    outside strings. Both are exact enough to refuse a 32 MB list of zeros or 100 000 nested arrays in a few
    milliseconds, and loose only for documents far larger than any observation."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    where = f"{field}: " if field else ""
    if len(raw) > limits.body_bytes:
        raise PayloadTooLarge(f"{where}{len(raw)} bytes of JSON exceed the {limits.body_bytes}-byte limit", field=field)
    openings = raw.count(b"[") + raw.count(b"{")
    values = raw.count(b",") + openings + 1
    if values > limits.elements:
        raise InvalidRequest(f"JSON of up to {values} values is over the {limits.elements}-value limit (send "
                             "arrays as {\"b64\", \"dtype\", \"shape\"} or msgpack)", field=field)
    if openings > limits.json_depth:
        depth = _json_depth(raw)
        if depth > limits.json_depth:
            raise InvalidRequest(f"JSON nested {depth} deep is over the {limits.json_depth}-level limit", field=field)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"malformed JSON: {_first_line(exc)}", field=field) from None


def _json_depth(raw: bytes) -> int:
    """Deepest nesting of brackets outside strings (strings removed, then every other byte)."""
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def unpack_msgpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """One msgpack frame with msgpack's own per-container limits and a running count of every value, so
    that 60 MB of empty maps stops after `limits.msgpack_elements` of them instead of building 60 M dicts.
    Arrays and maps are capped at 65 536 entries: the count (and a thread switch) happens at least that often."""
    import msgpack

    counted = 0

    def count(n: int) -> None:
        nonlocal counted
        counted += n + 1
        if counted > limits.msgpack_elements:
            raise WireError(f"more than {limits.msgpack_elements} values in one message (send arrays as "
                            "ndarray markers)")

    def on_map(obj: dict[Any, Any]) -> Any:
        count(len(obj))
        return decode_hook(obj)

    def on_list(obj: list[Any]) -> Any:
        count(len(obj))
        return obj

    if len(data) > limits.body_bytes:
        raise PayloadTooLarge(f"frame of {len(data)} bytes exceeds the {limits.body_bytes}-byte limit")
    try:
        return msgpack.unpackb(data, object_hook=on_map, list_hook=on_list, raw=False, strict_map_key=False,
                               max_bin_len=limits.body_bytes, max_str_len=limits.body_bytes,
                               max_array_len=2**16, max_map_len=2**16, max_ext_len=0)
    except WireError:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, ValueError (a limit), UnicodeDecodeError...
        raise WireError(f"malformed msgpack: {type(exc).__name__}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


# --- decoded size ---------------------------------------------------------------------------------------

def open_image(raw: bytes, field: str, max_pixels: int = DEFAULT_LIMITS.image_pixels, *,
               allow_frames: bool = False) -> np.ndarray | None:
    """PNG / JPEG / ... bytes -> uint8 RGB [H, W, 3], its size read from the header and checked before a pixel
    is decoded (`wire.decode_image`); a typed error naming `field` otherwise. With `allow_frames`, bytes that
    are not one still image (an animation, a video, anything Pillow cannot identify) give None: the caller
    decodes them as a video."""
    from PIL import Image

    if allow_frames:
        try:
            with Image.open(io.BytesIO(raw)) as im:
                if getattr(im, "n_frames", 1) > 1:
                    return None
        except Image.DecompressionBombError:
            pass  # a still image, too large: decode_image says so
        except Exception:  # noqa: BLE001  # not an image Pillow reads: maybe a video
            return None
    return decode_image(raw, field, max_pixels)


# --- prompt tokens --------------------------------------------------------------------------------------

def check_prompt(text: str, field: str, tokenizer: Any, max_tokens: int, *,
                 flag: str = "--max-generation-prompt-tokens", template_tokens: int | None = None) -> int:
    """Tokens of `text` by the served `tokenizer` (its chat template included, or the text's own when
    `template_tokens`, the template's tokens around an empty caption, is given) -- or its UTF-8 byte count, an
    upper bound, when that is already within `max_tokens` -- or InvalidRequest naming `flag` when over
    `max_tokens`. One over
    `MAX_BYTES_PER_TOKEN * max_tokens` characters or bytes is refused uncounted, so a megabyte is never
    tokenized. Without a tokenizer the byte count is the bound (never fewer than a byte-level BPE's tokens)."""
    if len(text) > MAX_BYTES_PER_TOKEN * max_tokens:
        raise InvalidRequest(f"{len(text)} characters is over the {max_tokens}-token limit ({flag})", field=field)
    n_bytes = len(text.encode("utf-8", "surrogatepass"))
    if n_bytes <= max_tokens:
        return n_bytes
    if n_bytes > MAX_BYTES_PER_TOKEN * max_tokens or tokenizer is None:
        raise InvalidRequest(f"{n_bytes} bytes is over the {max_tokens}-token limit ({flag})", field=field)
    tokens = len(tokenizer.encode(text).text_ids)
    if template_tokens is not None:
        tokens -= template_tokens
    if tokens > max_tokens:
        what = "chat template included" if template_tokens is None else "the instruction's own"
        raise InvalidRequest(f"{tokens} tokens ({what}) is over this server's {max_tokens} ({flag})", field=field)
    return tokens


# --- world generation's cost ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerationCost:
    """Time of one denoising step of the served checkpoint: its FLOPs at the job's token count over a device rate.

    A step runs every vision token of each CFG branch through every layer: the projections and the MLP (2 FLOPs
    per weight) plus attention over the text prefix and the generated tokens (4 FLOPs per head dim per key).
    The rate on CUDA is a measured bf16 matmul's times `CUDA_EFFICIENCY` (Nano's 480p i2v step, 113 TFLOP in
    ~190 ms on the H200, is ~0.8 of such a matmul: the estimate errs on the slow side). On a CPU it is
    `CPU_FLOPS`: the tiny checkpoints reach 0.3-12 GFLOP/s in a step on a shared 2-core box (dispatch overhead,
    not arithmetic, dominates them; a bare matmul there does 160+), so a measured matmul would accept steps 50x
    too long. The estimate is order-of-magnitude: it refuses an 8192 x 8192 frame (a 4-minute CPU step) or a
    2048 x 2048 one at once, and lets the sizes the bound allows through."""

    layers: int
    hidden: int
    attn_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    mlp_width: int
    gated: bool
    patch: int
    flops_per_s: float
    max_step_ms: float
    max_job_s: float

    CPU_FLOPS = 2e9
    CUDA_EFFICIENCY = 0.5

    @classmethod
    def of(cls, model: Any, *, max_step_ms: float | None, max_job_s: float, step_segments: int = 1
           ) -> GenerationCost:
        cfg = model.config
        param = next(model.parameters())
        cuda = param.device.type == "cuda"
        rate = measured_matmul_rate(param.device, param.dtype) * cls.CUDA_EFFICIENCY if cuda else cls.CPU_FLOPS
        if max_step_ms is None:
            # The policy waits at most one segment of a step: 250 ms of it (a CUDA step is split in segments).
            max_step_ms = 250.0 * (step_segments if cuda else 1)
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                   cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size, bool(cfg.gated_mlp),
                   cfg.latent_patch_size, rate, max_step_ms, max_job_s)

    def tokens(self, num_frames: int, height: int, width: int) -> int:
        """Vision tokens of one branch (VAE: 4x in time, 16x in space; then the transformer's patch)."""
        latent_t = (num_frames - 1) // 4 + 1
        return latent_t * -(-(height // 16) // self.patch) * -(-(width // 16) // self.patch)

    def step_ms(self, num_frames: int, height: int, width: int, *, text_tokens: int, branches: int) -> float:
        n = self.tokens(num_frames, height, width)
        per_token = 2 * (2 * self.hidden * self.attn_width + 2 * self.hidden * self.kv_width
                         + (3 if self.gated else 2) * self.hidden * self.mlp_width)
        attention = 4 * self.attn_width * (n + text_tokens)
        return 1e3 * branches * self.layers * n * (per_token + attention) / self.flops_per_s

    def check(self, *, num_frames: int, height: int, width: int, steps: int, count: int, text_tokens: int,
              branches: int, size_field: str) -> float:
        """The estimated step time (ms), or InvalidRequest naming the field that makes the job too large."""
        step = self.step_ms(num_frames, height, width, text_tokens=text_tokens, branches=branches)
        if step > self.max_step_ms:
            frames_field = "num_frames" if num_frames > 1 and self.step_ms(
                1, height, width, text_tokens=text_tokens, branches=branches) <= self.max_step_ms else size_field
            raise InvalidRequest(f"{width}x{height} x {num_frames} frames is ~{step:.0f} ms per denoising step on this "
                                 f"server, over its {self.max_step_ms:.0f} ms (--max-step-ms)", field=frames_field)
        job_s = step * steps * count / 1e3
        if job_s > self.max_job_s:
            raise InvalidRequest(f"{steps} steps{f' x {count} images' if count > 1 else ''} at ~{step:.0f} ms is "
                                 f"~{job_s:.0f} s, over this server's {self.max_job_s:.0f} s (--max-job-s)",
                                 field="n" if count > 1 and step * steps / 1e3 <= self.max_job_s
                                 else "num_inference_steps")
        return step


_RATES: dict[tuple[str, str], float] = {}


def measured_matmul_rate(device: Any, dtype: Any) -> float:
    """FLOP/s of a 4096 x 4096 x 4096 matmul in `dtype` on a CUDA `device` (best of a few; measured once)."""
    import torch

    key = (str(device), str(dtype))
    if key not in _RATES:
        a = torch.randn(4096, 4096, device=device, dtype=dtype)
        b = torch.randn(4096, 4096, device=device, dtype=dtype)
        a @ b  # warm-up (cuBLAS heuristics, clocks)
        best = math.inf
        for _ in range(5):
            torch.cuda.current_stream(device).synchronize()  # not the device: a capture may be under way
            t0 = time.perf_counter()
            a @ b
            torch.cuda.current_stream(device).synchronize()
            best = min(best, time.perf_counter() - t0)
        del a, b
        _RATES[key] = 2 * 4096**3 / max(best, 1e-9)
    return _RATES[key]
