"""World generation over several ranks: CFG-parallel × Ulysses sequence parallelism on `WorldEngine`.

Layout `cfg × ulysses` (`WorldLayout`): ranks split first by CFG branch (ranks [0, u) run the conditional branch,
[u, 2u) the unconditional one), then by sequence (rank c·u + s holds the s-th share of its branch's Generator
rows). Process subgroups: one sequence group per branch (the all-to-alls around attention) and one CFG pair per
sequence share (the velocity exchange).

* CFG-parallel: each branch's Generator pass runs on its own ranks (the conditional one on the first, the
  unconditional one and transfer's no-control pass on the second); per step one all-gather of the velocities
  over the CFG pair (only this rank's rows of them), after which both ranks apply the same guidance combine and
  solver step, so their states stay equal.
* Ulysses (`parallel.ulysses`): the sampler state is this rank's rows of the latents as tokens (`_Shard`); the
  input embedding, every norm, projection and MLP and the output projection run on those rows; each attention is
  wrapped in the two all-to-alls (the engine's `_pre` / `_post` pieces, wrapped here). The Reasoner K/V is
  computed in full on every rank, once per prompt (it is short), and each rank attends with its heads' slice.
  The full latents are gathered once, after the last step.

Nothing in the model changes: the engine's pieces (`_embed`, `_pre`, `_post`, `_finish`), branch selection and
velocity step are overridden here, as `parallel.cfg` does for the policy engine.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine.config import EngineConfig
from ..engine.kv_buffers import BatchBranch, KVBufferArena
from ..engine.prefix_cache import StackedKV, kv_storage
from ..engine.qkv_epilogue import repeat_heads
from ..engine.world import WORLD_ENGINE_CONFIG, WorldEngine
from ..model import GeneratorOutput, GeneratorTokens, Rope
from ..model.embeddings import patchify, unpatchify
from ..pipeline.denoise import DenoiseResult
from .dist import all_gather_into
from .ulysses import HeadSplit, SequenceLayout, chunk, heads_to_rows, rows_to_heads

# Per-request tensors a sampler reads that are shaped like the vision latents (the distilled sampler's pre-drawn
# re-noising draws and clean-frame anchor): sharded into this rank's token rows like the state.
VISION_LIKE_INPUTS = ("step_noise", "anchor_clean", "anchor_keep")


@dataclass(frozen=True)
class WorldLayout:
    """`cfg` (1 or 2) CFG branches × `ulysses` sequence shares per branch = cfg · ulysses ranks."""

    cfg: int
    ulysses: int

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def of(cls, mode: str, gpus: int) -> WorldLayout:
        """"ulysses" (all `gpus` on the sequence), "cfg,ulysses" (2 × gpus / 2) or "cfg" (2 × 1)."""
        parts = tuple(p.strip() for p in mode.split(","))
        if parts == ("cfg",):
            layout = cls(2, 1)
        elif parts == ("ulysses",):
            layout = cls(1, gpus)
        elif set(parts) == {"cfg", "ulysses"} and len(parts) == 2:
            if gpus % 2:
                raise ValueError(f"--parallel cfg,ulysses splits the GPUs into 2 CFG branches: --gpus {gpus} is odd")
            layout = cls(2, gpus // 2)
        else:
            raise ValueError(f"world parallel layout must be 'cfg', 'ulysses' or 'cfg,ulysses', got {mode!r}")
        if layout.world != gpus:
            raise ValueError(f"--parallel {mode} runs on {layout.world} GPUs, not --gpus {gpus}")
        return layout

    def check(self, heads: int, kv_heads: int) -> None:
        """One-line ValueError when the model's heads do not split at this degree."""
        if self.cfg not in (1, 2):
            raise ValueError(f"CFG-parallel has 1 or 2 branches per request, got {self.cfg}")
        HeadSplit(heads, kv_heads, self.ulysses)

    def describe(self) -> str:
        return " × ".join([*(["cfg 2"] if self.cfg == 2 else []), f"ulysses {self.ulysses}"])


@dataclass(frozen=True)
class WorldGroups:
    """This rank's place in a `WorldLayout` and its process subgroups (None where the dimension is 1)."""

    cfg_rank: int
    seq_rank: int
    seq: dist.ProcessGroup | None  # the ranks of this rank's branch (Ulysses all-to-alls)
    cfg: dist.ProcessGroup | None  # this rank and the other branch's rank of the same sequence share

    @classmethod
    def make(cls, layout: WorldLayout) -> WorldGroups:
        """Every rank of the default group must call this, with the same layout (subgroup creation is
        collective)."""
        if dist.get_world_size() != layout.world:
            raise ValueError(f"layout {layout.describe()} needs {layout.world} ranks, the group has "
                             f"{dist.get_world_size()}")
        rank, u = dist.get_rank(), layout.ulysses
        seq_groups = [dist.new_group([c * u + s for s in range(u)]) for c in range(layout.cfg)] if u > 1 else []
        cfg_groups = [dist.new_group([s, u + s]) for s in range(u)] if layout.cfg == 2 else []
        return cls(rank // u, rank % u, seq_groups[rank // u] if seq_groups else None,
                   cfg_groups[rank % u] if cfg_groups else None)


class _Shard:
    """One request's Generator rows on this rank: the latents as tokens ([1, rows, features]; vision patches, then
    sound frames), the sequence layouts of its passes, and the gather of the final state."""

    def __init__(self, engine: ParallelWorldEngine, vision: torch.Tensor, sound: torch.Tensor | None,
                 controls: torch.Tensor | None) -> None:
        self.engine = engine
        self.patch = engine.model.config.latent_patch_size
        self.vision_shape = tuple(vision.shape)  # [1, C, T, H, W]
        self.sound_shape = None if sound is None else tuple(sound.shape)  # [1, S, Ts]
        _, _, t, h, w = self.vision_shape
        self.per_frame = (-(-h // self.patch)) * (-(-w // self.patch))
        self.vision_tokens = t * self.per_frame
        self.sound_tokens = 0 if sound is None else sound.shape[2]
        self.degree, self.rank = engine.layout.ulysses, engine.groups.seq_rank
        # A transfer request's controls are videos on the vision grid, in front of the vision tokens.
        self.controls = () if controls is None else (self.vision_tokens,) * controls.shape[1]
        self.layouts: dict[tuple[int, ...], SequenceLayout] = {}
        for c in dict.fromkeys(((), self.controls)):  # built here, outside any graph capture (host data)
            self.layout(c)
        # patchify zero-pads an odd latent height or width inside the edge tokens; a latent-shaped state never holds
        # those slots, a token-shaped one must keep them at zero (their velocity is zeroed).
        self.real_slots = (None if (h % self.patch, w % self.patch) == (0, 0) else
                           self.vision_rows(torch.ones(1, *self.vision_shape[1:], device=vision.device)).bool())

    @property
    def geometry(self) -> tuple:
        return self.vision_shape, self.sound_shape, self.controls

    def segments(self, controls: tuple[int, ...] = ()) -> tuple[int, ...]:
        return (*controls, self.vision_tokens, *((self.sound_tokens,) if self.sound_shape else ()))

    def layout(self, controls: tuple[int, ...]) -> SequenceLayout:
        segments = self.segments(controls)
        found = self.layouts.get(segments)
        if found is None:
            found = self.layouts[segments] = SequenceLayout(segments, self.degree, self.rank, self.engine.device)
        return found

    def vision_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor broadcastable to [..., C, T, H, W] -> this rank's vision tokens [..., rows, C·p²]."""
        x = x.expand(*x.shape[:-4], *self.vision_shape[1:])
        lead = x.shape[:-4]
        a, b = chunk(self.vision_tokens, self.degree, self.rank)
        tokens = patchify(x.reshape(-1, *self.vision_shape[1:]), self.patch)[:, a:b]
        return tokens.reshape(*lead, b - a, tokens.shape[-1])

    def vision_noisy_rows(self, noisy: torch.Tensor) -> torch.Tensor:
        """[1, T] per-frame mask -> [1, rows] per token."""
        a, b = chunk(self.vision_tokens, self.degree, self.rank)
        return noisy.repeat_interleave(self.per_frame, dim=1)[:, a:b]

    def sound_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[1, S, Ts] -> [1, rows, S]; a [1, Ts] mask -> [1, rows]."""
        a, b = chunk(self.sound_tokens, self.degree, self.rank)
        return x.transpose(1, 2)[:, a:b] if x.ndim == 3 else x[:, a:b]

    def gather(self, vision: torch.Tensor, sound: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's rows of the final state -> the full latents [1, C, T, H, W] (and sound [1, S, Ts])."""
        _, _, t, h, w = self.vision_shape
        full = unpatchify(self._gather_rows(vision, self.vision_tokens), t, h, w, self.patch)
        return full, None if sound is None else self._gather_rows(sound, self.sound_tokens).transpose(1, 2)

    def _gather_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        most = -(-n // self.degree)
        mine = F.pad(x, (0, 0, 0, most - x.shape[1])).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.degree)]
        dist.all_gather(parts, mine, group=self.engine.groups.seq)
        return torch.cat([p[:, :b - a] for r, p in enumerate(parts) for a, b in [chunk(n, self.degree, r)]], dim=1)


class ParallelWorldEngine(WorldEngine):
    """`WorldEngine` for one rank of a `WorldLayout` (cfg × ulysses ranks). Every rank runs the same calls with the
    same request; their results are equal (the full latents, gathered at the end)."""

    reuse_compatible_graphs = False  # every rank must capture and replay the same graphs in lockstep

    def __init__(self, model, encoder, tokenizer, config: EngineConfig = WORLD_ENGINE_CONFIG, *, layout: WorldLayout,
                 groups: WorldGroups, **kwargs: Any) -> None:
        cfg = model.config
        layout.check(cfg.num_attention_heads, cfg.num_key_value_heads)
        if not (config.reuse_reasoner and config.batch_cfg):
            raise ValueError("parallel world generation needs reuse_reasoner=True and batch_cfg=True")
        # Every rank must make the same graph-cache decisions: no eviction by bytes (captures differ in size per
        # rank). With Ulysses the last layer runs every row (its row selection reads q's global rows against the
        # local hidden states).
        config = replace(config, graph_cache_bytes=0,
                         last_layer_read_rows=config.last_layer_read_rows and layout.ulysses == 1)
        super().__init__(model, encoder, tokenizer, config, **kwargs)
        self.layout, self.groups = layout, groups
        self._lengths: tuple[int, ...] = ()  # both branches' prefix lengths (CFG-parallel graph keys)
        self._with_uncond = False  # the request has an unconditional branch (CFG-parallel: the second rank's)
        self._shard: _Shard | None = None  # the request's rows (Ulysses)
        self._pass: SequenceLayout | None = None  # the running Generator pass's layout (Ulysses)
        self.sharded = layout.ulysses > 1  # the Ulysses path (state as this rank's rows, attention exchanged)
        if self.sharded:
            self.heads = HeadSplit(cfg.num_attention_heads, cfg.num_key_value_heads, layout.ulysses)
            self._head_slices: OrderedDict[int, tuple[Any, StackedKV]] = OrderedDict()
            # Each rank's K/V buffers hold its heads only.
            local = cfg.replace(num_attention_heads=self.heads.local_heads,
                                num_key_value_heads=self.heads.local_kv_heads)
            self.kv_arena = KVBufferArena(local, self.device, layout=self.cfg_attention, grouped=self.gqa_buffers,
                                          backend=config.attention, bucket_attention=self.bucket_attention,
                                          rescale=self._rescale)
            self._pre_rows, self._post_rows = self._pre, self._post
            self._embed, self._pre, self._post, self._finish = (self._embed_shard, self._pre_shard,
                                                                self._post_shard, self._finish_shard)

    def metadata(self) -> dict:
        meta = super().metadata()
        meta["engine"] = {**meta["engine"], "parallel": self.layout.describe(), "gpus": self.layout.world}
        return meta

    # The request's state as this rank's rows (Ulysses) ---------------------------------------------
    def _denoise_world(self, inp, extra, spec, on_step, on_segment, need_uncond=None, on_stage=None) -> DenoiseResult:
        if not self.sharded:
            return super()._denoise_world(inp, extra, spec, on_step, on_segment, need_uncond, on_stage=on_stage)
        shard = self._shard = _Shard(self, inp.vision, inp.sound, inp.controls)
        rows = replace(inp, vision=shard.vision_rows(inp.vision),
                       vision_noisy=shard.vision_noisy_rows(inp.vision_noisy))
        if inp.sound is not None:
            rows = replace(rows, sound=shard.sound_rows(inp.sound), sound_noisy=shard.sound_rows(inp.sound_noisy))
        extra = {k: shard.vision_rows(v) if k in VISION_LIKE_INPUTS else v for k, v in extra.items()}
        out = super()._denoise_world(rows, extra, spec, on_step, on_segment, need_uncond, on_stage=on_stage)
        with torch.inference_mode():
            vision, sound = shard.gather(out.vision, out.sound)
        return DenoiseResult(vision, None, out.timings_ms, {}, sound)

    def _world_key(self, *args):
        key = super()._world_key(*args)
        # The local row counts do not identify the request on every rank alike; the full geometry does.
        return key if self._shard is None else replace(key, sampler=(*key.sampler, self._shard.geometry))

    def _generator_pieces(self, tok, bufs, rope, attn, pause_after=(), last_layer_rows="all", clean_frames=0):
        if not self.sharded:
            return (yield from super()._generator_pieces(tok, bufs, rope, attn, pause_after, last_layer_rows,
                                                         clean_frames))
        assert self._shard is not None
        layout = self._pass = self._shard.layout(self._shard.controls if tok.controls is not None else ())
        local = Rope(rope.cos[:, layout.mine], rope.sin[:, layout.mine])  # this rank's rows' global positions
        return (yield from super()._generator_pieces(tok, bufs, local, attn, pause_after))

    # The pieces of a pass on this rank's rows, attention over every row (Ulysses) ------------------
    def _embed_shard(self, tok: GeneratorTokens) -> torch.Tensor:
        """`Cosmos3Transformer.embed_generator` on this rank's rows (token-shaped latents), padded to the
        layout's row count."""
        model, dt = self.model, self.model.dtype
        temb = model.time_embedding(tok.timesteps)[:, None, :]
        parts = []
        if tok.controls is not None:  # clean control videos in front: this rank's chunk of each, no time embedding
            assert self._shard is not None
            for i in range(tok.controls.shape[1]):
                parts.append(model.proj_in(self._shard.vision_rows(tok.controls[:, i]).to(dt)))
        if tok.vision is not None:
            x = model.proj_in(tok.vision.to(dt))
            parts.append(torch.where(tok.vision_noisy[..., None], x + temb, x))
        if tok.sound is not None:
            x = model.audio_proj_in(tok.sound.to(dt)) + model.audio_modality_embed
            parts.append(torch.where(tok.sound_noisy[..., None], x + temb, x))
        g = torch.cat(parts, dim=1)
        assert self._pass is not None
        return F.pad(g, (0, 0, 0, self._pass.local - g.shape[1]))

    def _finish_shard(self, g: torch.Tensor, update: torch.Tensor | None, tok: GeneratorTokens) -> GeneratorOutput:
        """`finish_generator` on this rank's rows: velocities as token rows, zero on clean rows."""
        model, layout = self.model, self._pass
        assert layout is not None
        if update is not None:
            g = g + update
        g = model.norm_moe_gen(g)
        vision = sound = None
        if tok.vision is not None:
            at, n = layout.span(len(layout.segments) - (2 if tok.sound is not None else 1))
            v = model.proj_out(g[:, at:at + n])
            keep = tok.vision_noisy[..., None]
            if self._shard is not None and self._shard.real_slots is not None:
                keep = keep & self._shard.real_slots
            vision = torch.where(keep, v, torch.zeros_like(v))
        if tok.sound is not None:
            at, n = layout.span(len(layout.segments) - 1)
            s = model.audio_proj_out(g[:, at:at + n])
            sound = torch.where(tok.sound_noisy[..., None], s, torch.zeros_like(s))
        return GeneratorOutput(vision, sound, None)

    def _pre_shard(self, layer, g, update, rope, kbuf, vbuf, start):
        """The layer's q/k/v on this rank's rows (K/V staged at the repeated K/V heads), then one all-to-all to
        every row of this rank's heads; K/V stored in the step buffers, in sequence order, after the prefix."""
        layout, heads = self._pass, self.heads
        assert layout is not None
        rows = g.shape[1]
        stage = g.new_empty(2, g.shape[0], rows, heads.kv_total, kbuf.shape[-1])  # [k/v, S, rows, heads, d]
        q, g = self._pre_rows(layer, g, update, rope, stage[0].transpose(1, 2), stage[1].transpose(1, 2), 0)
        q, k, v = rows_to_heads([q.transpose(1, 2), stage[0], stage[1]], layout, self.groups.seq)
        n = layout.length
        kbuf[:, :, start:start + n] = repeat_heads(k.transpose(1, 2), kbuf.shape[1])
        vbuf[:, :, start:start + n] = repeat_heads(v.transpose(1, 2), vbuf.shape[1])
        return q.transpose(1, 2), g

    def _post_shard(self, layer, g, o):
        assert self._pass is not None
        return self._post_rows(layer, g, heads_to_rows(o, self._pass, self.groups.seq).transpose(1, 2))

    def _branch(self, request: int, branch) -> BatchBranch:
        b = super()._branch(request, branch)
        return b if not self.sharded else BatchBranch(b.request, self._my_heads(b.kv), b.rope)

    def _my_heads(self, kv) -> StackedKV:
        """This rank's (repeated) K/V heads of a cached Reasoner prefix, kept while the prefix is."""
        hit = self._head_slices.get(id(kv))
        if hit is not None and hit[0] is kv:
            self._head_slices.move_to_end(id(kv))
            return hit[1]
        h, r = self.heads, self.groups.seq_rank
        index = torch.tensor([(r * h.local_kv_heads + j) // h.kv_repeat for j in range(h.local_kv_heads)],
                             device=self.device)
        mine = StackedKV.over(kv_storage(kv).index_select(3, index), kv.key_mask)
        self._head_slices[id(kv)] = (kv, mine)
        while len(self._head_slices) > self.config.kv_cache_size:
            self._head_slices.popitem(last=False)
        return mine

    # Which passes this rank runs, and the velocity exchange (CFG-parallel) --------------------------
    def _sequences(self, inputs, need_uncond):
        if self.layout.cfg == 1:
            return super()._sequences(inputs, need_uncond)
        (inp,) = inputs
        # Both ranks tokenized both prompts: the graph key is the same function of the request on both.
        self._lengths = (inp.cond.input_ids.shape[1],) + ((inp.uncond.input_ids.shape[1],) if need_uncond else ())
        self._with_uncond = need_uncond
        # Without guidance the second rank holds the conditional branch (and shares its passes where it has no
        # other: `_owners`).
        branch = inp.uncond if need_uncond and self.groups.cfg_rank == 1 else inp.cond
        return [self._branch(0, branch)], []

    def _bucket_lengths(self, conds, unconds) -> tuple[int, ...]:
        if self.layout.cfg == 1:
            return super()._bucket_lengths(conds, unconds)
        return tuple(self._padded_length(n) for n in self._lengths)

    def _owners(self, kind: tuple[bool, bool]) -> list[tuple[str, tuple[int, ...]]]:
        """A step kind's velocity rows in order (cond, uncond with CFG, no-control with control guidance) and the CFG
        ranks that compute each: the unconditional and no-control passes on the second rank, the conditional one on
        the first, and on both when it is the step's only pass and the second rank holds it (no pass to wait for)."""
        cfg_on, cg_on = kind
        alone = not (cfg_on or cg_on or self._with_uncond)
        return ([("cond", (0, 1) if alone else (0,))] + ([("uncond", (1,))] if cfg_on else [])
                + ([("nocontrol", (1,))] if cg_on else []))

    def _world_groups(self, branches, spec):
        if self.layout.cfg == 1:
            return super()._world_groups(branches, spec)
        rank, out = self.groups.cfg_rank, {}
        for kind in dict.fromkeys(spec.kinds):
            rows = {"cond": (branches.conds, False), "uncond": (branches.conds, False),
                    "nocontrol": (branches.nocontrols, True)}
            out[kind] = [rows[name] for name, owners in self._owners(kind) if rank in owners]
        return out

    def _step_velocities(self, kind, groups, tok, spec):
        if self.layout.cfg == 1:
            return (yield from super()._step_velocities(kind, groups, tok, spec))
        owners = self._owners(kind)
        mine = [i for i, (_, ranks) in enumerate(owners) if self.groups.cfg_rank in ranks]
        vision = sound = None
        if groups:
            vision, sound = yield from super()._step_velocities(kind, groups, tok, spec)
        if len(mine) == len(owners):
            return vision, sound
        # One all-gather over the CFG pair: every rank's rows of every pass it ran, in their slots.
        shapes = [tuple(t.shape[1:]) for t in (tok.vision, tok.sound) if t is not None]
        widths = [math.prod(s) for s in shapes]
        slots = tok.vision.new_zeros(len(owners), sum(widths))
        if mine:
            ran = torch.cat([t.reshape(len(mine), -1) for t in (vision, sound) if t is not None], dim=1)
            for j, i in enumerate(mine):  # Python indices: no index tensor to copy in (a captured graph holds this)
                slots[i].copy_(ran[j])
        both = slots.new_empty(2 * len(owners), slots.shape[1])
        all_gather_into(both, slots, group=self.groups.cfg)  # [first rank's slots; second rank's]
        both = both.view(2, *slots.shape)
        rows = torch.stack([both[ranks[0], i] for i, (_, ranks) in enumerate(owners)])
        parts = [p.reshape(len(owners), *s) for p, s in zip(rows.split(widths, dim=1), shapes, strict=True)]
        return parts[0], parts[1] if tok.sound is not None else None


__all__ = ["ParallelWorldEngine", "WorldGroups", "WorldLayout"]
