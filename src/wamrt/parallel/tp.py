"""Tensor parallelism for the Cosmos 3 MoT, applied to a built model from outside (module swap).

Per layer, for BOTH weight sets (Reasoner and Generator):
* attention: q/k/v column-parallel by heads (rank r holds query heads [r H/n, (r+1) H/n) and the K/V
  heads they read, so GQA grouping stays local), the output projection row-parallel + one all-reduce;
* MLP: gate/up column-parallel over the hidden size, down row-parallel + one all-reduce.
Per-head norms, embeddings, input/output projections and the time MLP are replicated. After the
swap `model.config` describes the local shard (heads, K/V heads and hidden size divided by n), which
is all the engine reads; the full config stays on `model.tp.full_config`.

Two all-reduces per layer half; every rank ends each layer with the same residual stream, so the
sampler runs replicated and rank 0 answers. The all-reduce is a functional collective, traceable by
torch.compile and capturable in a CUDA graph.

Builders: `shard_model` slices an existing model (tests: equal to the unsharded one); `random_sharded`
builds on the meta device and materialises only this rank's shard on its device (Super, 128 GB bf16,
never sits on one GPU); `load_sharded` reads only this rank's slices of a diffusers checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model import Cosmos3Config, Cosmos3Transformer, get_config, init_random_
from ..model.layer import MLP, MoTAttention

# (dim, start, stop) of a parameter's slice in the full tensor; None = replicated.
Slice = tuple[int, int, int]


@dataclass
class TPInfo:
    rank: int
    world: int
    full_config: Cosmos3Config
    slices: dict[str, Slice]  # parameter name -> its slice of the full checkpoint tensor


def _group_name(group: dist.ProcessGroup | None) -> str | None:
    if group is None:
        if not dist.is_initialized():
            return None  # resolved at the first forward (a model sharded before the group exists)
        group = dist.group.WORLD
    return group.group_name


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # The functional collective ops by group name: plain tensors in, plain tensors out, so torch.compile
    # traces them (a string constant, no ProcessGroup object) and CUDA graphs capture them.
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split across ranks."""

    tp_group_name: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group_name is None:
            self.tp_group_name = _group_name(None)
        y = _all_reduce(F.linear(x, self.weight), self.tp_group_name)
        return y if self.bias is None else y + self.bias


def _take(p: torch.Tensor, dim: int, rank: int, world: int) -> tuple[nn.Parameter, Slice]:
    size = p.shape[dim] // world
    start = rank * size
    part = p.detach().narrow(dim, start, size).clone()  # clone: the full tensor can be freed
    return nn.Parameter(part, requires_grad=False), (dim, start, start + size)


def _column(lin: nn.Linear, name: str, rank: int, world: int, slices: dict[str, Slice]) -> None:
    lin.weight, slices[f"{name}.weight"] = _take(lin.weight, 0, rank, world)
    if lin.bias is not None:
        lin.bias, slices[f"{name}.bias"] = _take(lin.bias, 0, rank, world)
    lin.out_features = lin.weight.shape[0]


def _row(lin: nn.Linear, name: str, rank: int, world: int, slices: dict[str, Slice],
         group: dist.ProcessGroup | None) -> None:
    lin.weight, slices[f"{name}.weight"] = _take(lin.weight, 1, rank, world)
    lin.in_features = lin.weight.shape[1]
    lin.__class__ = RowParallelLinear
    lin.tp_group_name = _group_name(group)


def check_divisible(cfg: Cosmos3Config, world: int) -> None:
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor parallel over {world} ranks needs {what} ({n}) divisible by {world}")


def shard_model(model: Cosmos3Transformer, rank: int, world: int, group: dist.ProcessGroup | None = None
                ) -> Cosmos3Transformer:
    """Keep rank `rank`'s shard of every layer (in place; works on meta tensors too). Apply before
    `fuse_generator` (the engine fuses the local q/k/v and gate/up shards afterwards)."""
    if getattr(model, "tp", None) is not None:
        raise ValueError("model is already sharded")
    cfg = model.config
    check_divisible(cfg, world)
    slices: dict[str, Slice] = {}
    for i, layer in enumerate(model.layers):
        attn: MoTAttention = layer.self_attn
        if not hasattr(attn, "add_q_proj") or attn.add_q_proj is None:
            raise ValueError("shard the model before fusing its projections")
        pre = f"layers.{i}.self_attn"
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            _column(getattr(attn, name), f"{pre}.{name}", rank, world, slices)
        for name in ("to_out", "to_add_out"):
            _row(getattr(attn, name), f"{pre}.{name}", rank, world, slices, group)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        for mname in ("mlp", "mlp_moe_gen"):
            mlp: MLP = getattr(layer, mname)
            names = (["gate_proj"] if mlp.gated else []) + ["up_proj"]
            for name in names:
                _column(getattr(mlp, name), f"layers.{i}.{mname}.{name}", rank, world, slices)
            _row(mlp.down_proj, f"layers.{i}.{mname}.down_proj", rank, world, slices, group)
    model.config = cfg.replace(num_attention_heads=cfg.num_attention_heads // world,
                               num_key_value_heads=cfg.num_key_value_heads // world,
                               intermediate_size=cfg.intermediate_size // world)
    model.tp = TPInfo(rank, world, cfg, slices)
    return model


def _meta_shard(cfg: Cosmos3Config, rank: int, world: int, group, dtype: torch.dtype) -> Cosmos3Transformer:
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
    shard_model(model, rank, world, group)
    model.to(dtype)
    model.time_embedder.to(torch.float32)  # the checkpoint / reference keep the time MLP in fp32
    return model


def random_sharded(size: str, rank: int, world: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, *,
                   layers: int | None = None, seed: int = 0, group=None) -> Cosmos3Transformer:
    """Random weights at a registered size, only this rank's shard ever allocated (on `device`).

    Weights are drawn like `init_random_` (same scales: row-parallel shards are scaled by 1/sqrt(n) so
    each keeps the full fan-in's std); every rank draws the same stream, so replicated parameters
    agree across ranks. The values are not a slice of the unsharded random model (speed only)."""
    cfg = get_config(size)
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    model = _meta_shard(cfg, rank, world, group, dtype).to_empty(device=device)
    init_random_(model, seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RowParallelLinear):
                mod.weight.mul_(1.0 / math.sqrt(world))
    return model.eval().requires_grad_(False)


def load_sharded(path: str | Path, rank: int, world: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 *, group=None, weights: dict[str, Path] | None = None) -> Cosmos3Transformer:
    """A diffusers-layout checkpoint folder, reading only this rank's slice of each sharded tensor. `weights`: the
    tensor -> shard map (`CheckpointLayout.transformer_weights()`, a hub root index's), default the folder's own."""
    from ..model import checkpoint as ckpt

    folder = ckpt.resolve_folder(path)
    cfg = ckpt.read_config(folder)
    model = _meta_shard(cfg, rank, world, group, dtype)
    slices = model.tp.slices
    expected = dict(model.named_parameters())
    mapping = weights if weights is not None else ckpt.weight_files(folder)
    assert mapping is not None
    by_file: dict[Path, list[str]] = {}
    for k, f in mapping.items():
        by_file.setdefault(f, []).append(k)
    seen: set[str] = set()
    read_device = str(device) if device.type == "cuda" else "cpu"
    for f, keys in by_file.items():
        handle = ckpt._open(f, read_device)
        for key in keys:
            name = ckpt._canonical(key)
            if name in ckpt.UNUSED_KEYS:
                continue
            if name not in expected:
                raise ckpt.CheckpointError(f"{f}: unexpected tensor {key!r} (not a parameter of this config)")
            sl = slices.get(name)
            if sl is None:
                t = handle.get_tensor(key)
            else:
                dim, start, stop = sl
                view = handle.get_slice(key)
                t = view[start:stop] if dim == 0 else view[:, start:stop]
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ckpt.CheckpointError(f"{f}: tensor {key!r} slice has shape {list(t.shape)}, "
                                           f"expected {list(expected[name].shape)}")
            target = torch.float32 if name.startswith(ckpt.FP32_PREFIXES) else dtype
            ckpt._set_param(model, name, t.to(device=device, dtype=target))
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ckpt.CheckpointError(f"{folder}: missing tensors: {', '.join(missing[:8])}")
    return model.eval().requires_grad_(False)
