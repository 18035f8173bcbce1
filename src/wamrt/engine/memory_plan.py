"""The device-memory plan of a policy server, made before any weight is loaded.

A server on one GPU holds: the weights (transformer and VAE), the CUDA context, the Reasoner K/V of recent prompts,
the step K/V arena its captured graphs share, each graph's static inputs, the graph pool (the largest captured
loop's temporaries: captured graphs replay one at a time on one stream, so they share one pool), the temporaries of a
capture's warm-up runs and of a request run uncaptured, the VAE encode's graphs, and world-generation jobs. Each is
counted here from the model's config and the serving settings; a plan that does not fit names the part that does not
and what to change. `plan_serving` also sizes what was left to it (`--max-batch`, `--max-video-pixels`) to the
largest that fits.

The weights and the K/V buffers are exact (tensor sizes). Temporaries are estimates per token row of a Generator
pass (`ACTIVATION_ROW`), upper bounds of what the compiled layer keeps alive (its MLP's gate/up output, the
activation, the residual stream and the update it carries): 6 x (hidden + intermediate) elements a row, twice the
3 x (hidden + intermediate) the layer's liveness gives. Against the allocator: at 664bd5c 9.38 GiB of graph pools
(Nano, batch 8 and smaller, the VAE's included) where this counts 9.0 GiB for batch 8; at c543d5c, the default
server under an 80 GiB cap (H200, batch 1-8 at prefix widths 256 and 512), the loop's pool reached 9.58 GiB where
this counts 9.1, 5 % over, which the headroom covers; that server's peak reserved was 58.5 of its 80 GiB
(bench/results/load/2026-12-06-c543d5c-load-plan-h200/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..model import Cosmos3Config
from .kv_buffers import step_buffer_elements

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1 * GIB  # context, cuBLAS / cuDNN handles and workspaces, compiled kernels: outside the allocator
DEFAULT_LADDER = (1, 2, 4, 8)  # batch sizes captured; a batch pads up to the next one
IMAGE_TOKENS_PER_PIXEL = 1 / 1024  # a single frame: 16 x 16 VAE pixels per latent, 2 x 2 latents per token
VAE_ENCODE_BYTES_PER_PIXEL = 1024  # first-frame encode: 160 channels at full resolution, bf16, ~3 alive at once
# The decode's peak per pixel of its largest frame: 256 channels at full resolution, bf16, ~3 alive at once. (A video
# decodes a latent frame into 4 frames at a time, but has 4k + 1 frames: per pixel of the job it is no worse.)
VAE_DECODE_BYTES_PER_PIXEL = 1536
HEADROOM = 0.03  # of the capacity, never planned: allocator fragmentation and the estimates' error
MAX_GENERATION_SIDE_PIXELS = 8192 * 8192  # the largest frame a generation request may ask for (16..8192 a side)


class MemoryPlanError(ValueError):
    """A plan that does not fit the device: one line naming the part and what to change (`flag`)."""

    def __init__(self, message: str, *, part: str, flag: str) -> None:
        super().__init__(message)
        self.part, self.flag = part, flag


@dataclass(frozen=True)
class Part:
    name: str
    nbytes: int
    detail: str  # what was counted
    knob: str  # what to change when it does not fit


@dataclass
class MemoryPlan:
    capacity: int  # bytes the server may use (`--gpu-memory`, or the device's memory)
    device_total: int  # the device's memory (0: unknown, e.g. planned on a CPU)
    parts: list[Part] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # what was planned for (batch ladder, widths, ...)

    @property
    def total(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def free(self) -> int:
        return self.capacity - self.total

    @property
    def capped(self) -> bool:
        """A cap below the device's memory (emulating a smaller card)."""
        return 0 < self.capacity < self.device_total

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def describe(self) -> str:
        """One line: every part in GiB, the total and the capacity."""
        parts = ", ".join(f"{p.name} {p.nbytes / GIB:.1f}" for p in self.parts if p.nbytes)
        return f"{parts} = {self.total / GIB:.1f} of {self.capacity / GIB:.1f} GiB"

    def as_dict(self) -> dict[str, Any]:
        return {"capacity_gib": round(self.capacity / GIB, 2), "device_gib": round(self.device_total / GIB, 2),
                "gpu_memory_cap_gib": round(self.capacity / GIB, 2) if self.capped else None,
                "total_gib": round(self.total / GIB, 2), "free_gib": round(self.free / GIB, 2),
                "parts": {p.name: {"gib": round(p.nbytes / GIB, 3), "detail": p.detail} for p in self.parts},
                **self.settings}


@dataclass(frozen=True)
class ModelMemory:
    """What the model brings: its config, and the bytes of its weights as the server will hold them."""

    config: Cosmos3Config
    transformer_bytes: int
    vae_bytes: int
    recipe: str | None = None  # the quantization recipe of the weights (None: the model dtype)
    dtype_bytes: int = 2  # activations and K/V (bf16)
    generation: bool = True  # the model can generate worlds (a VAE decoder and a caption tokenizer)
    chat_bytes: int = 0  # the Reasoner chat's own weights (lm_head, vision tower); 0: the server will not chat


@dataclass(frozen=True)
class ServingMemory:
    """What the server is asked to serve. `max_batch` / `max_video_pixels` None: the largest that fits."""

    max_batch: int | None = None
    ladder: tuple[int, ...] = DEFAULT_LADDER
    widths: tuple[int, ...] = (256, 512)  # prefix width rungs (tokens)
    generator_tokens: int = 3093  # DROID, tier 480: 9 latent frames x 340 tokens + 33 action rows
    canvas_pixels: int = 544 * 640  # the VAE encode's input (the padded composite)
    grouped_buffers: bool = False  # step buffers at the K/V heads (flash-attn-4)
    shared_kv_buffer: bool = True
    prefix_cache_bytes: int = GIB  # Reasoner K/V of recent prompts and their padded copies
    max_video_pixels: int | None = None
    generation_jobs: bool = True  # serve world generation beside the policy
    chat_rows: int = 4  # Reasoner chat: requests decoded together (rows of one K/V cache) ...
    chat_context: int = 8192  # ... of this many tokens each


def activation_row_elements(config: Cosmos3Config) -> int:
    """Elements a token row of a Generator pass keeps alive at its peak, as planned (see the module docstring)."""
    return 6 * (config.hidden_size + config.intermediate_size)


def eager_row_elements(config: Cosmos3Config) -> int:
    """The same for a pass run uncompiled: every elementwise op materialises, the norms in fp32."""
    return 10 * config.hidden_size + 8 * config.intermediate_size


def ladder_for(max_batch: int, ladder: tuple[int, ...] = DEFAULT_LADDER) -> tuple[int, ...]:
    """The rungs of `ladder` below `max_batch`, and `max_batch` itself."""
    return tuple(sorted({b for b in ladder if b < max_batch} | {max_batch}))


def _kv_bytes_per_token(config: Cosmos3Config, dtype_bytes: int) -> int:
    """One prefix token's Reasoner K/V, every layer (what the prefix cache and a graph's static inputs hold)."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


def policy_parts(model: ModelMemory, serving: ServingMemory, max_batch: int) -> list[Part]:
    """The parts of serving policy requests in batches of up to `max_batch`."""
    cfg, db = model.config, model.dtype_bytes
    ladder, width, g = ladder_for(max_batch, serving.ladder), max(serving.widths), serving.generator_tokens
    heads = cfg.num_key_value_heads if serving.grouped_buffers else cfg.num_attention_heads

    def arena(batch: int) -> int:
        # CFG doubles the sequences; a guidance interval adds a cond-only pass's buffers (3 x batch in all)
        return db * step_buffer_elements(sequences=3 * batch, heads=heads, kv_heads=cfg.num_key_value_heads,
                                         prefix=width, generator=g, head_dim=cfg.head_dim,
                                         layers=cfg.num_hidden_layers, shared=serving.shared_kv_buffer)

    per_token = _kv_bytes_per_token(cfg, db)
    latents = (cfg.patch_latent_dim + (cfg.action_dim or 0)) * g * 4  # fp32 latents, vision and action
    inputs = sum(2 * b * w * per_token + b * latents for b in ladder for w in serving.widths)
    rows = 2 * max_batch * g  # both CFG branches of every request in one pass
    pool = rows * activation_row_elements(cfg) * db
    eager = 2 * g * eager_row_elements(cfg) * db + arena(1)
    return [
        Part("cuda_context", CUDA_CONTEXT_BYTES, "CUDA context, library handles and workspaces, kernels",
             "the card (--gpu-memory)"),
        Part("headroom", 0, f"{HEADROOM:.0%} of the capacity: fragmentation and the estimates' error",
             "the card (--gpu-memory)"),
        Part("weights", model.transformer_bytes + model.vae_bytes,
             f"transformer {model.transformer_bytes / GIB:.1f} GiB ({model.recipe or 'bf16'}), "
             f"VAE {model.vae_bytes / GIB:.1f} GiB", "the recipe (wamrt quantize --recipe gen-fp8+reasoner-w8: "
                                                       "--model the artifact) or the card"),
        Part("prefix_cache", serving.prefix_cache_bytes, "Reasoner K/V of recent prompts and their padded copies",
             "--max-prompt-tokens"),
        Part("step_kv_arena", arena(max_batch), f"K/V step buffers of a batch of {max_batch} at width {width}"
             f"{', one pair for every layer' if serving.shared_kv_buffer else ', per layer'}", "--max-batch"),
        Part("graph_inputs", inputs, f"static inputs of {len(ladder) * len(serving.widths)} graphs (batch "
             f"{'/'.join(map(str, ladder))} x width {'/'.join(map(str, serving.widths))})", "--max-batch"),
        Part("graph_pool", pool, f"temporaries of the batch-{max_batch} loop, one pool shared by every graph",
             "--max-batch"),
        Part("capture_warmup", pool + arena(max_batch),
             f"a capture's warm-up run of the batch-{max_batch} loop (outside the pool, fresh buffers)", "--max-batch"),
        Part("eager", eager, "a request run uncaptured while its graph is captured (one at a time)", "--max-batch"),
        Part("vae_encode", VAE_ENCODE_BYTES_PER_PIXEL * serving.canvas_pixels * max_batch,
             f"the first-frame encode's graphs, up to {max_batch} frames", "--max-batch"),
        Part("chat", model.chat_bytes + serving.chat_rows * serving.chat_context * per_token if model.chat_bytes else 0,
             f"the Reasoner chat: lm_head and vision weights, a K/V cache of {serving.chat_rows} x "
             f"{serving.chat_context} tokens", "--chat-max-batch (0: no chat) or --chat-context"),
    ]


def generation_bytes(model: ModelMemory, pixels: int, text_tokens: int = 512) -> int:
    """A world-generation job of up to `pixels` (width x height x frames x images), at its worst shape: one frame
    of all those pixels has the most tokens per pixel and the largest decode."""
    cfg, db = model.config, model.dtype_bytes
    tokens = math.ceil(pixels * IMAGE_TOKENS_PER_PIXEL)
    rows = 2 * tokens  # both CFG branches
    kv = db * step_buffer_elements(sequences=2, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                                   prefix=text_tokens, generator=tokens, head_dim=cfg.head_dim,
                                   layers=cfg.num_hidden_layers, shared=True)
    decode = VAE_DECODE_BYTES_PER_PIXEL * min(pixels, MAX_GENERATION_SIDE_PIXELS)
    return rows * activation_row_elements(cfg) * db + kv + decode


def _largest_pixels(model: ModelMemory, budget: int) -> int:
    """The most pixels a generation job may have within `budget` bytes (0 if not even a 16 x 16 frame fits)."""
    lo, hi = 0, 1 << 34
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if generation_bytes(model, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo if lo >= 256 else 0


def plan_serving(model: ModelMemory, serving: ServingMemory, *, capacity: int, device_total: int = 0) -> MemoryPlan:
    """The plan for `serving` on `capacity` bytes: the largest ladder batch that fits (with a generation job of
    `max_video_pixels`, when given) when `max_batch` is None, then the largest generation job in what is left when
    `max_video_pixels` is None. Raises `MemoryPlanError` naming the first part that does not fit (in the order
    above) and what to change."""
    generation = model.generation and serving.generation_jobs
    pixels = serving.max_video_pixels if generation else None

    def parts_for(batch: int) -> list[Part]:
        parts = policy_parts(model, serving, batch)
        parts[1] = replace(parts[1], nbytes=int(HEADROOM * capacity))
        if pixels is not None:
            parts.append(Part("generation", generation_bytes(model, pixels), f"a world-generation job of up to "
                              f"{pixels} pixels (worst shape: one frame of them)", "--max-video-pixels"))
        return parts

    batches = [serving.max_batch] if serving.max_batch is not None else sorted(set(serving.ladder), reverse=True)
    parts = next((p for p in map(parts_for, batches) if sum(q.nbytes for q in p) <= capacity), None)
    if parts is None:
        _refuse(parts_for(batches[-1]), capacity, explicit_batch=serving.max_batch, model=model)
    assert parts is not None
    batch = batches[0] if serving.max_batch is not None else max(b for b in batches if parts_for(b) == parts)
    if generation and pixels is None:
        left = capacity - sum(p.nbytes for p in parts)
        pixels = _largest_pixels(model, left)
        if pixels == 0:
            raise MemoryPlanError(f"world generation does not fit: {left / GIB:.1f} GiB are left after the policy "
                                  f"parts ({sum(p.nbytes for p in parts) / GIB:.1f} of {capacity / GIB:.1f} GiB); "
                                  "lower --max-batch", part="generation", flag="--max-batch")
        parts.append(Part("generation", generation_bytes(model, pixels), f"a world-generation job of up to {pixels} "
                          "pixels (worst shape: one frame of them)", "--max-video-pixels"))
    settings: dict[str, Any] = {"max_batch": batch, "ladder": list(ladder_for(batch, serving.ladder)),
                                "widths": list(serving.widths), "recipe": model.recipe,
                                "shared_kv_buffer": serving.shared_kv_buffer, "max_video_pixels": pixels}
    return MemoryPlan(capacity, device_total, parts, settings)


def _refuse(parts: list[Part], capacity: int, *, explicit_batch: int | None, model: ModelMemory) -> None:
    """Raise for the first part that takes the total past `capacity`, naming what to change."""
    total = 0
    for p in parts:
        if total + p.nbytes > capacity:
            left = max(capacity - total, 0)
            knob = p.knob
            if knob == "--max-batch":
                knob = (f"--max-batch (asked: {explicit_batch}; 1 is the least)" if explicit_batch
                        else "the recipe (wamrt quantize --recipe gen-fp8+reasoner-w8) or --max-prompt-tokens: "
                             "--max-batch 1 does not fit either")
            elif p.name == "generation":
                most = _largest_pixels(model, left)
                knob = f"--max-video-pixels ({most} fits)" if most else "--max-video-pixels, or --max-batch"
            raise MemoryPlanError(
                f"{p.name} ({p.nbytes / GIB:.1f} GiB: {p.detail}) does not fit the {left / GIB:.1f} GiB left of "
                f"{capacity / GIB:.1f} GiB after {', '.join(q.name for q in parts[: parts.index(p)] if q.nbytes)}; "
                f"change {knob}", part=p.name, flag=knob.split()[0] if knob.startswith("--") else "--model")
        total += p.nbytes
    raise AssertionError("_refuse called on a plan that fits")
