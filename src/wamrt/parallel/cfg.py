"""CFG-parallel: the two classifier-free-guidance branches on two ranks, one branch each.

Rank 0 runs the conditional branch, rank 1 the unconditional one, each through the ordinary `Engine`
(Reasoner K/V cache, fused + compiled layers, the whole loop as one CUDA graph) on a full copy of the
model. Per denoising step the ranks exchange their velocities with one all-gather (vision and action
packed into one buffer), so both hold [cond; uncond] and apply the identical CFG combine and solver
update: their latents stay equal and rank 0's answer is the request's answer. Steps outside the
guidance interval need only the conditional branch: rank 0 computes it and broadcasts it.

The collectives run on the engine's stream and are captured in its CUDA graph like any other kernel
(NCCL supports stream capture). Nothing in the model changes; only the engine's branch selection and
velocity step are overridden here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.engine import Engine
from ..engine.kv_buffers import BatchBranch
from ..model import GeneratorOutput
from .dist import all_gather_into


@dataclass
class _Step:
    groups: list  # the local branch's Generator groups (empty when this rank runs no branch)
    cfg: bool  # a guided step: all-gather both branches; else rank 0 broadcasts the conditional one


class CfgParallelEngine(Engine):
    """`Engine` for one rank of a 2-rank CFG-parallel group (the default process group)."""

    reuse_compatible_graphs = False  # both ranks must capture and replay the same buckets in lockstep

    def __init__(self, *args, group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != 2:
            raise ValueError("CFG-parallel runs on exactly 2 ranks (one per guidance branch)")
        if not self.config.reuse_reasoner:
            raise ValueError("CFG-parallel needs reuse_reasoner=True (the branch-per-rank loop)")
        self._lengths: tuple[int, ...] = ()

    @classmethod
    def from_policy(cls, policy, config=None, *, group=None) -> CfgParallelEngine:  # type: ignore[override]
        from ..engine import EngineConfig

        return cls(policy.model, policy.encoder, policy.tokenizer, policy.contract, policy.options,
                   config or EngineConfig(), name=policy.name, quantization=policy.quantization, group=group)

    def metadata(self) -> dict:
        meta = super().metadata()
        meta["engine"] = {**meta["engine"], "parallel": "cfg", "gpus": 2}
        return meta

    # Which branch this rank runs ------------------------------------------------------------------
    def _sequences(self, inputs, need_uncond):
        # Both ranks know every prefix length (both tokenized both prompts), so the graph bucket key
        # is the same function of the request on both: they capture and replay in lockstep.
        self._lengths = tuple(inp.cond.input_ids.shape[1] for inp in inputs) + (
            tuple(inp.uncond.input_ids.shape[1] for inp in inputs) if need_uncond else ())
        if self.rank == 0:
            return [self._branch(r, inp.cond) for r, inp in enumerate(inputs)], []
        if not need_uncond:
            # No guided step: rank 1 only receives rank 0's velocities. It still holds the conditional
            # branch (never run: see _velocities) so the graph machinery has its usual shapes and dtypes.
            return [self._branch(r, inp.cond) for r, inp in enumerate(inputs)], []
        return [self._branch(r, inp.uncond) for r, inp in enumerate(inputs)], []

    def _bucket_lengths(self, conds: list[BatchBranch], unconds: list[BatchBranch]) -> tuple[int, ...]:
        # Each rank pads its own branches (prompt buckets), but the key comes from every length on both.
        return tuple(self._padded_length(n) for n in self._lengths)

    def _step_batches(self, conds, unconds, n):
        local = super()._step_batches(conds, [], n)[False] if conds else []
        return {False: _Step(local, cfg=False), True: _Step(local, cfg=True)}

    # One step's velocities: local branch + one collective ---------------------------------------
    def _velocities(self, step, tok, raw_dim, last_layer_rows="all"):
        if not isinstance(step, _Step):  # not ours (e.g. a caller passing plain groups)
            return super()._velocities(step, tok, raw_dim, last_layer_rows)
        action_rows_only = last_layer_rows == "action"
        n = tok.timesteps.shape[0]
        vshape, ashape = tuple(tok.vision.shape), tuple(tok.action.shape)
        # action_rows_only: the ranks' passes return actions only, and only those travel
        dv, da = 0 if action_rows_only else _numel(vshape[1:]), _numel(ashape[1:])
        dtype = self.model.dtype
        if step.groups and (step.cfg or self.rank == 0):  # unguided steps: rank 0's branch only
            out = super()._velocities(step.groups, tok, raw_dim, last_layer_rows)
            parts = [] if action_rows_only else [out.vision.reshape(n, dv).to(dtype)]
            local = torch.cat([*parts, out.action.reshape(n, da).to(dtype)], dim=1)
        else:
            local = torch.empty(n, dv + da, dtype=dtype, device=self.device)
        if step.cfg:
            both = torch.empty(2 * n, dv + da, dtype=dtype, device=self.device)
            all_gather_into(both, local.contiguous(), group=self.group)  # rows: [cond; uncond]
        else:
            dist.broadcast(local, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
            both = local
        rows = both.shape[0]
        vision = None if action_rows_only else both[:, :dv].reshape(rows, *vshape[1:])
        return GeneratorOutput(vision, None, both[:, dv:].reshape(rows, *ashape[1:]))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
