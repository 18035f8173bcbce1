"""Analytic FLOP counts of one request and the floors of ../shared/docs/performance.md."""

from __future__ import annotations

from ..model import Cosmos3Config

# performance.md (H200, tier 480, DROID request, cond/uncond text 125/30): bf16 compute floor (100% of
# 790 TFLOP/s) and the practical floor (sum of GEMM + attention kernels today's libraries reach), ms.
COMPUTE_FLOOR_MS = {("edge", 4): 114.0, ("edge", 2): 57.0, ("nano", 4): 506.0, ("nano", 2): 253.0,
                    ("super", 4): 2213.0, ("super", 2): 1107.0}
PRACTICAL_FLOOR_MS = {("edge", 4): 136.0, ("edge", 2): 68.0, ("nano", 4): 595.0, ("nano", 2): 297.5}
VAE_FRAME0_MS = 10.0  # performance.md: frame-0 Wan2.2 encode
TARGET_MS = {("edge", 4): 160.0, ("edge", 2): 85.0, ("nano", 4): 660.0, ("nano", 2): 338.0}  # issue 4


def stream_linear_params(cfg: Cosmos3Config) -> int:
    """Linear weights one token meets in one stream over all layers."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = (3 if cfg.gated_mlp else 2) * h * f
    return cfg.num_hidden_layers * (attn + mlp)


def request_flops(cfg: Cosmos3Config, *, text: list[int], gen_tokens: int, cfg_steps: list[bool],
                  reasoner_once: bool = True) -> float:
    """FLOPs of one request: Generator linears + attention per step per active branch, plus the
    Reasoner (once per branch, or inside every forward for the reference pattern)."""
    p = stream_linear_params(cfg)
    hd = cfg.num_attention_heads * cfg.head_dim
    layers = cfg.num_hidden_layers
    cond, uncond = text[0], text[1] if len(text) > 1 else 0

    def reasoner(u: int) -> float:
        return 2.0 * u * p + layers * 2.0 * u * u * hd

    def generator(u: int) -> float:
        return 2.0 * gen_tokens * p + layers * 4.0 * gen_tokens * (u + gen_tokens) * hd

    total = 0.0
    for active in cfg_steps:
        total += generator(cond) + (generator(uncond) if active else 0.0)
        if not reasoner_once:
            total += reasoner(cond) + (reasoner(uncond) if active else 0.0)
    if reasoner_once:
        total += reasoner(cond) + (reasoner(uncond) if any(cfg_steps) else 0.0)
    return total


def guidance_share(cfg: Cosmos3Config, cfg_steps: list[bool], *, reasoner_once: bool = True) -> float:
    """A DROID request's FLOPs with CFG on `cfg_steps` over its FLOPs with CFG on every step: what the floors above
    (which assume the latter) scale by for a guidance interval."""
    def request(steps: list[bool]) -> float:
        return request_flops(cfg, text=[125, 30], gen_tokens=3092, cfg_steps=steps, reasoner_once=reasoner_once)

    return request(cfg_steps) / request([True] * len(cfg_steps))


# fp8 W8A8 Generator GEMMs (performance.md: rowwise torch._scaled_mm), tier 480, 4 / 2 steps.
FP8_COMPUTE_FLOOR_MS = {("edge", 4): 68.0, ("edge", 2): 34.0, ("nano", 4): 282.0, ("nano", 2): 141.0,
                        ("super", 4): 1211.0, ("super", 2): 605.0}
FP8_PRACTICAL_FLOOR_MS = {("edge", 4): 98.0, ("edge", 2): 49.0, ("nano", 4): 385.0, ("nano", 2): 192.5}
FP8_TARGET_MS = {("edge", 4): 118.0, ("edge", 2): 64.0, ("nano", 4): 434.0, ("nano", 2): 222.0}  # issue 7
