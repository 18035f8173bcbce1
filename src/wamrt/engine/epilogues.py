"""The Generator layer's tail (after attention) with the elementwise work inside the GEMMs' epilogues.

`MoTLayer.generator_post` is out-projection + residual, norm, MLP (gate/up, SiLU*up or ReLU^2, down) + residual.
Compiled by Inductor, the GEMMs are cuBLAS calls and everything between them is Triton kernels that read and
write the GEMM outputs once more: at Nano the gate/up output alone is 6,186 x 24,576 bf16 (304 MB) per layer
and step, which SiLU*up reads back to write half of it. Each GEMM of the tail has a fused form here:

    g = g + o @ W_out^T             residual as the GEMM's C operand
    a = act(norm(g) @ W_up^T)       SwiGLU (interleaved gate/up columns) or ReLU^2 on the fp32 accumulator
    g = g + a @ W_down^T            residual again

and each call site runs the form that measured faster (`SM90_SITES`): on the H200 the activation GEMMs are
quack's and the residual GEMMs stay cuBLAS + Inductor (quack's GEMM is slower there than the add it saves).

The kernels are quack's (`quack-kernels`, Tri Dao's CuTe DSL GEMMs for Hopper and Blackwell; it comes with
flash-attn-4), an optional dependency, behind two custom ops so that `torch.compile` sees one opaque call per GEMM
and compiles the norm around them. The activation is applied to the fp32 accumulator before the one rounding to
bf16 (Inductor's path rounds gate and up first): not bit-identical to the unfused layer, no less accurate; the GPU
test compares both with an fp32 oracle. `generator_post_reference` is the same dataflow in plain PyTorch (CPU tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..model import Cosmos3Transformer
from ..model.layer import MLP, MoTLayer
from .fuse import FusedGateUp, fuse_generator

EPILOGUES = ("inductor", "quack")


def quack_available(device: torch.device | None = None) -> bool:
    """quack-kernels importable and the GPU one of its GEMM architectures (sm90 Hopper, sm100 Blackwell)."""
    if not torch.cuda.is_available():
        return False
    try:
        import quack.gemm_interface  # noqa: F401
    except Exception:  # ImportError, or the CuTe DSL failing to find its libraries
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def activation_of(mlp: MLP) -> str:
    return "swiglu" if mlp.gated else "relu_sq"


def act_reference(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation on a GEMM output; SwiGLU reads interleaved columns (gate 0, up 0, gate 1, ...)."""
    if activation == "swiglu":
        return F.silu(y[..., 0::2]) * y[..., 1::2]
    if activation == "relu_sq":
        return torch.relu(y).square()
    raise ValueError(f"activation must be 'swiglu' or 'relu_sq', got {activation!r}")


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[I, K] and [I, K] -> [2I, K] with rows gate 0, up 0, gate 1, up 1, ..."""
    return torch.stack((gate, up), dim=1).flatten(0, 1)


# -- quack behind custom ops ---------------------------------------------------------------------------------

Tiles = tuple[int, int, bool, int, int]  # (tile_m, tile_n, pingpong, cluster_m, cluster_n)
QUACK_DEFAULT: Tiles = (128, 192, True, 2, 1)  # quack 0.6.5's Hopper default
# Per call site (epilogue, K, N) on Hopper: the tiles `wamrt bench kernels --sweep` measured fastest on the H200, or
# None where cuBLAS + Inductor's kernel measured faster than every quack tile (that site keeps the unfused path).
# H200 at 809fa37, 10 calls per CUDA graph (bench/results/kernels/2026-12-02-809fa37/): the activation sites win
# (Edge up+ReLU^2 0.313 vs 0.387 ms, Nano gate/up+SwiGLU 1.857 vs 2.014), every residual site loses (Edge out 0.086
# vs 0.088 before Inductor fuses the add into the next norm, Edge down 0.423 vs 0.347, Nano out 0.346 vs 0.294,
# Nano down 1.014 vs 0.926). Sites not listed take their epilogue kind's default below. Pinned, not autotuned:
# quack's autotuner compiles ~40 CuTe DSL kernels per epilogue kind at the first call of a shape, minutes of
# warm-up a server should not pay.
SM90_SITES: dict[tuple[str, int, int], Tiles | None] = {
    ("relu_sq", 2048, 9216): QUACK_DEFAULT,
    ("swiglu", 4096, 24576): QUACK_DEFAULT,
    ("residual", 2048, 2048): None,
    ("residual", 9216, 2048): None,
    ("residual", 4096, 4096): None,
    ("residual", 12288, 4096): None,
}
SM90_DEFAULT: dict[str, Tiles | None] = {"residual": None, "relu_sq": QUACK_DEFAULT, "swiglu": QUACK_DEFAULT}
SWEEP_TILES: list[Tiles] = [
    QUACK_DEFAULT, (128, 128, True, 2, 1), (128, 256, False, 2, 1), (256, 128, False, 2, 1), (256, 192, False, 2, 1),
    (256, 192, False, 1, 2),
]


def gemm_config(tiles: Tiles | None):
    """A quack GemmConfig for Hopper from (tile_m, tile_n, pingpong, cluster_m, cluster_n); None: quack's default."""
    if tiles is None:
        return None
    from quack.gemm_config import GemmConfig

    tile_m, tile_n, pingpong, cluster_m, cluster_n = tiles
    return GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=cluster_n,
                      is_dynamic_persistent=False, device_capacity=9)


def site_tiles(epilogue: str, k: int, n: int, capability: int) -> list[int] | None:
    """The tile list a call site's custom op gets ([] = quack's default for the GPU), or None: stay on cuBLAS."""
    if capability != 9:
        return []
    tiles = SM90_SITES.get((epilogue, k, n), SM90_DEFAULT[epilogue])
    return None if tiles is None else [int(t) for t in tiles]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def gemm_residual_2d(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config=None) -> torch.Tensor:
    """residual + x @ weight^T for 2D x [M, K], weight [N, K], residual [M, N], on one quack GEMM with `config`."""
    from quack.gemm_interface import gemm_tuned

    out = torch.empty_like(residual)
    gemm_tuned.fn(x, weight.t(), out, residual, config=config)  # the kernel without the autotuner
    return out


def gemm_act_2d(x: torch.Tensor, weight: torch.Tensor, activation: str, config=None) -> torch.Tensor:
    """act(x @ weight^T) for 2D x on one quack GEMM with `config`; the pre-activation is never written."""
    from quack.gemm_interface import gemm_act

    _, post = gemm_act(x, weight.t(), activation=activation, store_preact=False, tuned=False, config=config)
    return post


def _config(tiles: list[int]):
    return gemm_config((tiles[0], tiles[1], bool(tiles[2]), tiles[3], tiles[4])) if tiles else None


@torch.library.custom_op("wamrt::gemm_residual", mutates_args=(), device_types="cuda")
def quack_gemm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, tiles: list[int]
                        ) -> torch.Tensor:
    """residual + x @ weight^T in one GEMM (x [..., K], weight [N, K], residual [..., N]); `tiles` as `site_tiles`."""
    out = gemm_residual_2d(_rows(x), weight, _rows(residual), _config(tiles))
    return out.view(residual.shape)


@quack_gemm_residual.register_fake
def _(x, weight, residual, tiles):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.custom_op("wamrt::gemm_act", mutates_args=(), device_types="cuda")
def quack_gemm_act(x: torch.Tensor, weight: torch.Tensor, activation: str, tiles: list[int]) -> torch.Tensor:
    """act(x @ weight^T) in one GEMM (x [..., K], weight [N, K]; SwiGLU halves N); `tiles` as `site_tiles`."""
    post = gemm_act_2d(_rows(x), weight, activation, _config(tiles))
    return post.view(*x.shape[:-1], post.shape[-1])


@quack_gemm_act.register_fake
def _(x, weight, activation, tiles):
    n = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    return x.new_empty(*x.shape[:-1], n)


def _torch_gemm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + F.linear(x, weight)


def _torch_gemm_act(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    return act_reference(F.linear(x, weight), activation)


# -- the layer tail ----------------------------------------------------------------------------------------


def _tail(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor, gemm_residual: Callable, gemm_act: Callable
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g, the MLP's update still to add) where the down-projection's site runs unfused; (g with it added, None)
    where its GEMM adds the residual in the epilogue."""
    mlp = layer.mlp_moe_gen
    g = gemm_residual(o.transpose(1, 2).flatten(2), layer.self_attn.to_add_out.weight, g)
    h = layer.post_attention_layernorm_moe_gen(g)
    a = gemm_act(h, mlp.epilogue_weight, activation_of(mlp))
    return gemm_residual(a, mlp.down_proj.weight, g, defer=True)


def _summed(pair: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    g, update = pair
    return g if update is None else g + update


def _torch_tail_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, defer: bool = False):
    return (residual, F.linear(x, weight)) if defer else _torch_gemm_residual(x, weight, residual)


def generator_post_reference(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The same dataflow and weight layout in plain PyTorch: what the quack path computes, on any device."""
    return _summed(_tail(layer, g, o, _torch_tail_residual, _torch_gemm_act))


def quack_generator_post(device: torch.device, *, split: bool = False) -> Callable:
    """`layer.generator_post(g, o)` on quack's fused-epilogue GEMMs for `device`'s architecture, each call site on
    its pinned tiles or on cuBLAS where that measured faster (needs `prepare_epilogues(model)`). The choices are
    Python decisions on the weights' shapes, so a compiled tail holds only the chosen kernels. With `split`, the
    form of `layer.generator_post_split`: (g, update) with update None where the down-projection's GEMM added it."""
    capability = torch.cuda.get_device_capability(device)[0]

    def gemm_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, defer: bool = False):
        tiles = site_tiles("residual", weight.shape[1], weight.shape[0], capability)
        if tiles is None:
            return _torch_tail_residual(x, weight, residual, defer)
        out = quack_gemm_residual(x, weight, residual, tiles)
        return (out, None) if defer else out

    def gemm_act(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
        tiles = site_tiles(activation, weight.shape[1], weight.shape[0], capability)
        if tiles is None:
            return _torch_gemm_act(x, weight, activation)
        return quack_gemm_act(x, weight, activation, tiles)

    def generator_post_split(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor):
        return _tail(layer, g, o, gemm_residual, gemm_act)

    def generator_post(layer: MoTLayer, g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return _summed(_tail(layer, g, o, gemm_residual, gemm_act))

    return generator_post_split if split else generator_post


class InterleavedGateUp(FusedGateUp):
    """Fused gate/up whose matrix rows alternate gate, up (the layout a SwiGLU epilogue reads pairs from)."""

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        y = self.gate_up_proj(x)
        return y[..., 0::2], y[..., 1::2]

    @property
    def epilogue_weight(self) -> torch.Tensor:
        return self.gate_up_proj.weight


class EpilogueMLP(MLP):
    """Un-gated (ReLU^2) MLP: the up-projection's matrix is the epilogue GEMM's as it is."""

    @property
    def epilogue_weight(self) -> torch.Tensor:
        return self.up_proj.weight


def unsupported_reason(model: Cosmos3Transformer) -> str | None:
    """Why the fused-epilogue tail cannot serve this model's Generator layers, or None."""
    layer = model.layers[0]
    mlp = layer.mlp_moe_gen
    linears = [layer.self_attn.to_add_out, mlp.down_proj]
    if isinstance(mlp, FusedGateUp):
        linears.append(mlp.gate_up_proj)
    else:
        linears += [mlp.gate_proj, mlp.up_proj] if mlp.gated else [mlp.up_proj]
    for lin in linears:
        if type(lin) is not nn.Linear or lin.bias is not None:
            return f"{type(lin).__name__} (bias: {getattr(lin, 'bias', None) is not None}) is not a plain bf16 linear"
        if lin.weight.dtype not in (torch.bfloat16, torch.float16):
            return f"weights are {lin.weight.dtype}, the epilogue GEMMs take bf16 / fp16"
    return None


def prepare_epilogues(model: Cosmos3Transformer) -> Cosmos3Transformer:
    """Fuse the Generator (`fuse_generator`) with gate/up rows interleaved, and give every Generator MLP an
    `epilogue_weight`. Idempotent; a model fused earlier with [gate; up] rows is re-laid out in place (the math of
    its modules stays the same)."""
    fuse_generator(model)
    for layer in model.layers:
        mlp = layer.mlp_moe_gen
        if isinstance(mlp, InterleavedGateUp | EpilogueMLP):
            continue
        if mlp.gated:
            w = mlp.gate_up_proj.weight
            gate, up = w.detach().chunk(2, dim=0)
            mlp.gate_up_proj.weight = nn.Parameter(interleave_rows(gate, up), requires_grad=False)
            mlp.__class__ = InterleavedGateUp
        else:
            mlp.__class__ = EpilogueMLP
    return model
