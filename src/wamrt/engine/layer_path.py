"""Which code runs each piece of a Generator pass, chosen once from an `EngineConfig` and the device.

A pass is: the input embedding, then per layer the half before attention (`pre`: q/k/v and the K/V buffer
stores), attention, the half after it (`post`), and at the end the last residual add, the final norm and the
output projections (`finish`). Each piece has an exact bf16 form (`layer_halves`) and faster forms applied from
outside the model: quack GEMM epilogues, the fused gen-fp8 layer (`fp8_fusion`), the Triton q/k/v head epilogue
(`qkv_epilogue`), and regional compilation (one compiled graph per piece, re-used by every layer).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..model import Cosmos3Transformer, GeneratorOutput, GeneratorTokens
from ..ops.attention import rescale_zero_keys
from .config import EngineConfig
from .epilogues import prepare_epilogues, quack_available, quack_generator_post, unsupported_reason
from .fp8_fusion import (
    TRITON_SITES,
    fp8_fusion_problem,
    fp8_generator_norm_quant,
    fp8_generator_post_split,
    fp8_generator_projections,
    fp8_generator_qkv,
)
from .fuse import fuse_generator
from .layer_halves import generator_projections, generator_qkv, post_split, pre_fp8_heads, pre_heads, pre_into
from .qkv_epilogue import fp8_qkv_heads_problem, head_epilogue_problem

log = logging.getLogger(__name__)

CUBLASLT_WORKSPACE_ENV = "CUBLASLT_WORKSPACE_SIZE"  # KiB; torch reads it at every cuBLASLt call


@dataclass(frozen=True)
class LayerPath:
    """The pieces of a Generator pass as the engine calls them, and what was resolved to pick them."""

    embed: Callable  # (tokens) -> g
    pre: Callable  # (layer, g, update, rope, kbuf, vbuf, start) -> (q, g)
    post: Callable  # (layer, g, attention output) -> (g, update)
    finish: Callable  # (g, update, tokens) -> GeneratorOutput
    rescale: Callable  # zero-key attention rows rescaled by their log-sum-exp (prompt buckets)
    head_epilogue: str  # "triton" or "inductor", "auto" resolved
    fp8_triton_gemms: tuple[str, ...]  # fused gen-fp8 GEMM sites off cuBLAS's default ("fast_accum" included)
    fp8_fast_accum: bool


def finish_generator(model: Cosmos3Transformer, g: torch.Tensor, update: torch.Tensor | None,
                     tok: GeneratorTokens) -> GeneratorOutput:
    """The last layer's residual add (its MLP output `update`, if not added yet), the final norm and the output
    projections -> velocities."""
    if update is not None:
        g = g + update
    return model.decode_generator(model.norm_moe_gen(g), tok)


def build_layer_path(model: Cosmos3Transformer, config: EngineConfig, device: torch.device) -> LayerPath:
    """The pieces `config` asks for on `device`. Raises ValueError, before touching the model, when quack
    epilogues cannot run; later, when a forced head epilogue cannot. Fuses the model's Generator projections when
    compiling (every engine sharing the model then sees the fused layers)."""
    if config.epilogues == "quack":
        if not quack_available(device):
            raise ValueError("epilogues='quack' needs quack-kernels installed and a Hopper or Blackwell GPU")
        if (problem := unsupported_reason(model)) is not None:
            raise ValueError(f"epilogues='quack' cannot serve this model: {problem}")
    post = post_split
    if config.epilogues == "quack":
        prepare_epilogues(model)
        post = quack_generator_post(device, split=True)
    qkv, projections = generator_qkv, generator_projections
    triton_gemms: tuple[str, ...] = ()
    fast_accum = False
    if config.fp8_quantize == "fused" and fp8_fusion_problem(model.layers[0]) is None:  # (quack refuses fp8)
        qkv, projections, post = fp8_generator_qkv, fp8_generator_projections, fp8_generator_post_split
        fast_accum = config.fp8_fast_accum
        sites = frozenset(config.fp8_triton_gemms) | ({"fast_accum"} if config.fp8_fast_accum else set())
        if sites:
            triton_gemms = tuple(s for s in TRITON_SITES if s in sites)
            qkv, projections, post = (partial(f, gemm_choices=sites) for f in (qkv, projections, post))
    head_epilogue = config.head_epilogue
    head_problem = head_epilogue_problem(model.layers[0].self_attn, device, model.dtype)
    if head_epilogue == "auto":
        head_epilogue = "inductor" if head_problem else "triton"
    elif head_epilogue == "triton" and head_problem:
        raise ValueError(f"head_epilogue='triton' cannot serve this model here: {head_problem}")
    if "qkv_heads" in triton_gemms:
        problem = "head_epilogue is not 'triton'" if head_epilogue != "triton" else \
            fp8_qkv_heads_problem(model.layers[0].self_attn, device, model.dtype)
        if problem:
            raise ValueError(f"fp8_triton_gemms 'qkv_heads' cannot serve this model here: {problem}")

    def finish(g: torch.Tensor, update: torch.Tensor | None, tok: GeneratorTokens) -> GeneratorOutput:
        return finish_generator(model, g, update, tok)

    pre, embed, rescale = pre_into(qkv), model.embed_generator, rescale_zero_keys
    if config.compile:
        fuse_generator(model)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.inline_inbuilt_nn_modules = True  # parameters as inputs: one graph, all layers
        # Regional compilation: one compiled graph for the repeated layer code (parameters are graph inputs),
        # re-used by every layer. generator_pre runs inside the compiled pre_into. The compiled wrappers live on
        # the engine, not on the model's layers: engines (and the eager reference Policy) share one model, and a
        # compile=False engine must run uncompiled code.
        compiled = partial(torch.compile, dynamic=False,
                           mode=None if config.compile_mode == "default" else config.compile_mode)
        if "qkv_heads" in triton_gemms:  # two custom ops, nothing for Inductor between them
            pre = pre_fp8_heads(fp8_generator_norm_quant)
        elif head_epilogue == "triton":  # the kernel launches outside the compiled region
            pre = pre_heads(compiled(projections))
        else:
            pre = compiled(pre)
        post = compiled(post)
        # The step's edges: eager, the fp32 final norm alone was ~10 kernels and ~0.2 ms per Edge step, and the
        # input embedding ~0.1 ms (bench/results/latency/2026-12-03-1ba1cea-fast-accum/, run2's trace).
        embed, finish, rescale = compiled(embed), compiled(finish), compiled(rescale)  # rescale: one fused kernel
    elif "qkv_heads" in triton_gemms:
        pre = pre_fp8_heads(fp8_generator_norm_quant)
    elif head_epilogue == "triton":
        pre = pre_heads(projections)
    return LayerPath(embed=embed, pre=pre, post=post, finish=finish, rescale=rescale, head_epilogue=head_epilogue,
                     fp8_triton_gemms=triton_gemms, fp8_fast_accum=fast_accum)


def use_workspace_free_gemms() -> bool:
    """cuBLASLt without a workspace for this process (`EngineConfig.workspace_free_gemms`), unless the environment
    already names a size. Returns whether it set it. Only ever lowers the size: torch allocates the workspace once,
    at its first cuBLASLt call, and a larger value later would promise cuBLASLt memory that was never allocated."""
    if CUBLASLT_WORKSPACE_ENV in os.environ:
        return False
    os.environ[CUBLASLT_WORKSPACE_ENV] = "0"
    log.info("cuBLASLt: no workspace for this process (%s=0): no memset before each large GEMM",
             CUBLASLT_WORKSPACE_ENV)
    return True
