"""`WorldEngine`: world generation (text/image/video -> video, with sound) on the engine's fast path.

The request path is `wamrt.pipeline.world.run_world`'s (validation, prompts, conditioning encode, noise,
decode); the engine swaps in its denoising loop and its VAE decode:
* the Reasoner runs once per CFG branch (K/V cached per prompt), both branches in one Generator pass;
* fused q/k/v and gate/up, the repeated layer halves compiled (what `Engine` does for policies);
* one CUDA graph per step, captured once per shape bucket. Not one graph for the whole loop as the policy
  path does: a 35-step video takes seconds, and a server must be able to report progress, cancel and hand
  the device to queued policy requests between steps. A replay costs the same either way; between steps the
  host only launches the next graph. A server splits each step further (`step_segments`: graphs of a few
  layers each), so a policy request that arrives mid-step waits for a fraction of a step, not all of it;
* prompts padded to `prompt_bucket`-token buckets (zero keys, see `EngineConfig.bucket_attention`), so a new
  prompt length does not cost a capture;
* the VAE decode without diffusers' padded copy before every causal convolution (`vae_decode`), its frames
  rounded to uint8 on the device (a quarter of the bytes to copy, no CPU rounding).
Results equal `run_world`'s up to bf16 rounding (GPU test) and exactly in fp32 on the CPU (CPU test).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from ..model import GeneratorTokens
from ..model.attention import ControlSegments
from ..ops.capture_turn import capture_turn, graph_capture
from ..pipeline.denoise import DenoiseInputs, DenoiseResult, SamplingOptions
from ..pipeline.omni import decode_pixels
from ..pipeline.tokens import CaptionTokenizer, as_caption_tokenizer
from ..pipeline.vae import FrameEncoder
from ..pipeline.world import WorldResult, run_world
from ..sampler import Anchor, DistilledPlan, cfg_combine, make_anchor
from .config import EngineConfig
from .engine import Engine
from .generator_pass import run_to_end, select_requests
from .graph_cache import CapturedGraph, CaptureTimer, GraphKey, tensor_bytes
from .graph_capture import clone_branch
from .kv_buffers import BatchBranch
from .prefix_cache import copy_lists
from .vae_decode import implicit_pad_decoder

# World prompts differ per request (prompt, negative prompt, duration/resolution sentences): without buckets
# every new prompt length would be a capture (a full loop's warm-up).
WORLD_ENGINE_CONFIG = EngineConfig(prompt_bucket=64, graph_cache_size=8)


def segment_ends(layers: int, segments: int) -> frozenset[int]:
    """The last layer of every segment but the final one (which also runs the output head and the solver), for
    `segments` runs of consecutive layers as even as they come."""
    return frozenset(round(k * layers / segments) - 1 for k in range(1, segments))


def leading_clean_frames(vision_noisy: torch.Tensor) -> int:
    """How many leading latent frames `vision_noisy` [B, T] marks clean in every request, when those are all of
    its clean frames and some frame is noisy; else 0 (the last layer then runs every row). A host read, once per
    request."""
    masks = vision_noisy.bool().tolist()
    first = masks[0]
    clean = first.index(True) if True in first else len(first)
    if any(m != first for m in masks) or clean == len(first) or not all(first[clean:]):
        return 0
    return clean


@dataclass(frozen=True, eq=False)
class _LoopSpec:
    """What a loop runs besides the model: the timesteps, which steps guide, how velocities combine, and the
    solver, built from the loop's static buffers (so a per-request tensor a solver reads, such as the distilled
    sampler's pre-drawn noise, is a captured graph's input)."""

    timesteps: tuple[float, ...]
    kinds: tuple[tuple[bool, bool], ...]  # per step: (CFG on, control guidance on)
    guidance: float
    upcast: bool  # velocities to fp32 before CFG and the solver (diffusers' order)
    solver: Callable[[dict], Any]  # static buffers -> a SamplerPlan (steps / init_history / step)
    key: tuple  # what identifies the sampler in a graph key
    # Leading latent frames the request holds clean (an image / video's conditioning), which the last layer skips
    # after its K/V stores (`EngineConfig.last_layer_read_rows`, `read_rows`; their velocity is zero), as it skips
    # a transfer request's control rows. Part of the graph key: a text -> video request's frame 0 is noisy.
    clean_frames: int = 0
    read_rows: bool = False
    control_guidance: float = 1.0
    controls: tuple[int, int] = (0, 0)  # a transfer request's (controls, tokens per control)


@dataclass(frozen=True, eq=False)
class _Branches:
    """A request's CFG branches as the engine runs them: conditional, unconditional (when CFG runs) and, for a
    transfer request with control guidance, the conditional text without the controls."""

    conds: list[BatchBranch]
    unconds: list[BatchBranch]
    nocontrols: list[BatchBranch]

    @property
    def all(self) -> list[BatchBranch]:
        return self.conds + self.unconds + self.nocontrols


class _WorldLoop:
    """One request's denoising loop as segments over shared state (one per step, or `step_segments` per step),
    so that each segment can be captured as its own CUDA graph and progress, cancellation and yielding fall
    between them. Segment 0 also writes the Reasoner prefixes into the step's K/V buffers (the prologue), so a
    replay of segment 0 reads whatever prefixes were copied into the static inputs."""

    def __init__(self, engine: WorldEngine, x_v: torch.Tensor, x_s: torch.Tensor | None, static: dict,
                 branches: _Branches, spec: _LoopSpec) -> None:
        self.engine, self.static, self.spec = engine, static, spec
        self.branches = branches
        self.plan = spec.solver(static)
        self.x_v, self.x_s = x_v, x_s
        self.hist_v, self.hist_s = self.plan.init_history(), self.plan.init_history()
        self.kinds: dict | None = None
        self.graphs: list[list] = []  # per step, its captured segments' graphs, when captured

    def step(self, i: int) -> None:
        run_to_end(self.pieces(i))

    def pieces(self, i: int) -> Generator[None, None, None]:
        """Step `i`, pausing (yielding) where the engine splits a step into segments."""
        engine, spec, static = self.engine, self.spec, self.static
        if self.kinds is None:
            self.kinds = engine._world_batches(self.branches, spec)
        dtype = engine.model.dtype
        tok = GeneratorTokens(
            timesteps=torch.full((1,), float(spec.timesteps[i]), device=engine.device),
            vision=self.x_v.to(dtype), vision_noisy=static["vision_noisy"],
            sound=None if self.x_s is None else self.x_s.to(dtype), sound_noisy=static.get("sound_noisy"),
            controls=static.get("controls"), control_weights=static.get("control_weights"),
        )
        kind = spec.kinds[i]
        vision, sound = yield from engine._step_velocities(kind, self.kinds[kind], tok, spec)
        cfg_on, cg_on = kind

        def combine(v: torch.Tensor, controls: bool) -> torch.Tensor:
            """rows [cond; uncond if CFG; no-control if control guidance] -> the guided velocity, as
            `pipeline.denoise` forms it."""
            if spec.upcast:
                v = v.float()
            c = cfg_combine(v[:1], v[-1:], spec.control_guidance) if controls and cg_on else v[:1]
            return cfg_combine(c, v[1:2], spec.guidance) if cfg_on else c

        self.x_v, self.hist_v = self.plan.step(i, self.x_v, combine(vision, True), self.hist_v)
        if self.x_s is not None:
            assert sound is not None
            self.x_s, self.hist_s = self.plan.step(i, self.x_s, combine(sound, False), self.hist_s)


class WorldEngine(Engine):
    """World generation with the engine's techniques; `run(**run_world keywords)` is `run_world` made fast."""

    def __init__(self, model, encoder: FrameEncoder, tokenizer: CaptionTokenizer | Any,
                 config: EngineConfig = WORLD_ENGINE_CONFIG, *, name: str = "",
                 implicit_pad_decode: bool = True, step_segments: int = 1) -> None:
        """`step_segments` > 1 splits every denoising step into that many segments of consecutive layers (each
        its own graph; `on_segment` runs between them): for a server that yields the device to policy requests
        mid-step. Alone (a benchmark, `wamrt generate`) one segment per step is the fastest: no host sync
        between segments."""
        if config.isolate_requests:
            raise ValueError("isolate_requests is a policy-batching switch; a world request always runs alone")
        layers = len(model.layers)
        if not 1 <= step_segments <= layers:
            raise ValueError(f"step_segments must be in [1, {layers}] (the model's layers), got {step_segments}")
        super().__init__(model, encoder, as_caption_tokenizer(tokenizer), config=config, name=name)
        self.implicit_pad_decode = implicit_pad_decode
        self.step_segments = step_segments
        self.pause_after = segment_ends(layers, step_segments)

    def run(self, *, on_segment: Callable[[], None] | None = None, on_stage: Callable[[str], None] | None = None,
            **kwargs: Any) -> WorldResult:
        """`run_world(model, encoder, tokenizer, **kwargs)` with this engine's loop and decode; `on_segment` is
        called between the segments of a step (see `step_segments`), after the device finished the previous one;
        `on_stage(name)` between the request's stages, the Reasoner prefill ("reasoner prefilled") among them."""
        return run_world(self.model, self.encoder, self.tokenizer, on_stage=on_stage,
                         denoiser=partial(self.denoise, on_segment=on_segment, on_stage=on_stage),
                         decoder=self.decode_pixels, **kwargs)

    def run_distilled(self, *, on_segment: Callable[[], None] | None = None,
                      on_stage: Callable[[str], None] | None = None, **kwargs: Any) -> WorldResult:
        """`run_world_distilled(model, encoder, tokenizer, **kwargs)` (a distilled checkpoint's few-step sampler)
        with this engine's loop and decode; `on_segment` as in `run`."""
        from ..pipeline.world_distilled import run_world_distilled

        return run_world_distilled(self.model, self.encoder, self.tokenizer,
                                   denoiser=partial(self.denoise_distilled, on_segment=on_segment, on_stage=on_stage),
                                   on_stage=on_stage,
                                   decoder=self.decode_pixels, **kwargs)

    def decode_pixels(self, encoder: FrameEncoder, latents: torch.Tensor, *, notes: list[str] | None = None
                      ) -> torch.Tensor:
        """The VAE decode with implicit-padding causal convolutions (`vae_decode`), pixels left on the device:
        run_world rounds them to uint8 there and copies a quarter of the bytes (the float frames' host copy and CPU
        rounding cost ~180 ms of an i2v request at 480x832x33; same ops, same bits). cuDNN autotuning of the
        convolutions measured no faster (869.8 vs 871.4 ms, H200)."""
        with implicit_pad_decoder(encoder.vae) if self.implicit_pad_decode else nullcontext():
            return decode_pixels(encoder, latents, to_host=False, notes=notes)

    # ---------------------------------------------------------------------------------------------
    def denoise(self, model, inp: DenoiseInputs, opts: SamplingOptions, *,
                on_step: Callable[[int, int], None] | None = None, on_segment: Callable[[], None] | None = None,
                on_stage: Callable[[str], None] | None = None, **_: Any) -> DenoiseResult:
        """`pipeline.denoise.denoise` on the fast path (same signature; `record` and `clock` are not offered)."""
        self._check_inputs(model, inp)
        timesteps = tuple(opts.make_schedule().timesteps.tolist())
        kinds = tuple(opts.step_kinds(list(timesteps)))
        if any(k[0] for k in kinds) and inp.uncond is None:
            raise ValueError("guidance != 1 needs an unconditional branch")
        if any(k[1] for k in kinds) and (inp.nocontrol is None or inp.controls is None):
            raise ValueError("control guidance != 1 needs controls and a branch without them")
        extra: dict[str, torch.Tensor] = {}
        controls = (0, 0)
        if inp.controls is not None:
            assert inp.control_weights is not None
            extra = {"controls": inp.controls.to(self.model.dtype), "control_weights": inp.control_weights}
            seg = ControlSegments.of(inp.controls, inp.control_weights, self.model.config.latent_patch_size)
            assert seg is not None
            controls = (seg.count, seg.tokens)
        plan = self._plan(opts)
        spec = _LoopSpec(timesteps, kinds, opts.guidance, upcast=not opts.cfg_in_model_dtype,
                         solver=lambda _static: plan,
                         key=("unipc", timesteps, kinds, opts.guidance, opts.control_guidance, opts.solver,
                              opts.cfg_in_model_dtype),
                         control_guidance=opts.control_guidance, controls=controls)
        return self._denoise_world(inp, extra, spec, on_step, on_segment, on_stage=on_stage)

    def denoise_distilled(self, model, inp: DenoiseInputs, plan: DistilledPlan, noise: torch.Tensor | None, *,
                          on_step: Callable[[int, int], None] | None = None,
                          on_segment: Callable[[], None] | None = None, on_stage: Callable[[str], None] | None = None,
                          **_: Any) -> DenoiseResult:
        """`pipeline.world_distilled.denoise_distilled` on the fast path: the conditional branch only, the
        pre-drawn re-noising draws and the clean-frame anchor as graph inputs."""
        self._check_inputs(model, inp)
        if inp.sound is not None:
            raise ValueError("the distilled sampler denoises vision only (no sound or action latents)")
        clean = ~inp.vision_noisy  # [1, T]
        anchored = bool(clean.any())  # the reference re-anchors only when some frame is conditioned (a host read)
        extra: dict[str, torch.Tensor] = {}
        if noise is not None:
            extra["step_noise"] = noise
        if anchored:
            anchor = make_anchor(inp.vision, clean[:, None, :, None, None])
            extra["anchor_clean"], extra["anchor_keep"] = anchor.clean, anchor.keep

        def solver(static: dict):
            bound_anchor = Anchor(static["anchor_clean"], static["anchor_keep"]) if anchored else None
            return plan.bind(static.get("step_noise"), bound_anchor)

        steps = plan.steps
        spec = _LoopSpec(tuple(plan.timesteps), ((False, False),) * steps, 1.0, upcast=True, solver=solver,
                         key=("distilled", tuple(plan.timesteps), tuple(plan.sigmas.tolist()), plan.stochastic,
                              anchored))
        return self._denoise_world(inp, extra, spec, on_step, on_segment, need_uncond=False, on_stage=on_stage)

    def _check_inputs(self, model, inp: DenoiseInputs) -> None:
        if model is not self.model:
            raise ValueError("WorldEngine runs the engine's own model")
        if inp.action is not None:
            raise ValueError("WorldEngine runs world generation; action modes go through Engine / the pipeline")
        if inp.controls is not None and inp.sound is not None:
            raise ValueError("video transfer generates no sound")

    def _denoise_world(self, inp: DenoiseInputs, extra: dict[str, torch.Tensor], spec: _LoopSpec,
                       on_step: Callable[[int, int], None] | None, on_segment: Callable[[], None] | None,
                       need_uncond: bool | None = None,
                       on_stage: Callable[[str], None] | None = None) -> DenoiseResult:
        timings: dict[str, float] = {}
        if self.config.last_layer_read_rows:
            spec = replace(spec, clean_frames=leading_clean_frames(inp.vision_noisy), read_rows=True)
        with torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            conds, unconds = self._sequences([inp], any(k[0] for k in spec.kinds) if need_uncond is None
                                             else need_uncond)
            nocontrols = []
            if any(k[1] for k in spec.kinds):  # the conditional text (its cached K/V), positions without controls
                assert inp.nocontrol is not None
                nocontrols = [self._branch(0, inp.nocontrol)]
            if self.config.prompt_bucket:
                conds, rest = self._pad_prefixes(conds, unconds + nocontrols)
                unconds, nocontrols = rest[:len(unconds)], rest[len(unconds):]
            branches = _Branches(conds, unconds, nocontrols)
            self._sync()
            timings["reasoner_prefill"] = 1e3 * (time.perf_counter() - t0)
            if on_stage is not None:
                on_stage("reasoner prefilled")

            t0 = time.perf_counter()
            static = {"vision_noisy": inp.vision_noisy, **extra}
            if inp.sound is not None:
                static["sound_noisy"] = inp.sound_noisy
            steps = len(spec.timesteps)
            if self.config.cuda_graph:
                x_v, x_s = self._replay(inp.vision, inp.sound, static, branches, spec, on_step=on_step,
                                        on_segment=on_segment)
            else:
                loop = _WorldLoop(self, inp.vision, inp.sound, static, branches, spec)
                for i in range(steps):
                    for _ in loop.pieces(i):
                        if on_segment is not None:
                            self._sync()
                            on_segment()
                    if on_step is not None:
                        self._sync()
                        on_step(i, steps)
                x_v, x_s = loop.x_v, loop.x_s
            self._sync()
            timings["denoise"] = 1e3 * (time.perf_counter() - t0)
        return DenoiseResult(x_v, None, timings, {}, x_s)

    def _world_key(self, x_v, x_s, branches: _Branches, spec: _LoopSpec) -> GraphKey:
        sampler = ("world", () if x_s is None else tuple(x_s.shape[1:]), spec.key, spec.clean_frames, spec.controls)
        return GraphKey(1, tuple(x_v.shape[1:]), (),
                        self._bucket_lengths(branches.conds, branches.unconds + branches.nocontrols), sampler,
                        bucketed=bool(self.config.prompt_bucket))

    def _world_groups(self, branches: _Branches, spec: _LoopSpec) -> dict[tuple[bool, bool], list]:
        """Per step kind, the Generator passes of a step: (branches, whether the pass drops the controls). The
        no-control branch is a pass of its own: its sequence lacks the controls' tokens, so batched with the others
        it would be padded to their length (at one control, twice its tokens and four times its attention)."""
        out = {}
        for kind in dict.fromkeys(spec.kinds):  # first-seen order: warm-up and capture take the same arena regions
            cfg_on, cg_on = kind
            seqs = branches.conds + (branches.unconds if cfg_on else [])
            groups = [(seqs, False)] if self.config.batch_cfg else [([s], False) for s in seqs]
            out[kind] = groups + ([(branches.nocontrols, True)] if cg_on else [])
        return out

    def _step_velocities(self, kind: tuple[bool, bool], groups: list, tok: GeneratorTokens, spec: _LoopSpec
                         ) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """A step's Generator passes (`groups`: `_world_batches`' of the step's `kind`), pausing where the engine
        splits a step -> the velocity rows of vision and sound, [cond; uncond if CFG; no-control if control
        guidance]. (Where several GPUs share a step, `parallel.world` runs some passes here and fetches the rest.)"""
        outs = []
        for rows, bufs, rope, attn, drop_controls in groups:
            sel = select_requests(tok, rows)
            if drop_controls:
                sel = replace(sel, controls=None, control_weights=None)
            read = spec.read_rows and (spec.clean_frames > 0 or sel.controls is not None)
            outs.append((yield from self._generator_pieces(sel, bufs, rope, attn, self.pause_after,
                                                           "noisy" if read else "all", spec.clean_frames)))
        sound = None if outs[0].sound is None else torch.cat([o.sound for o in outs])
        return torch.cat([o.vision for o in outs]), sound

    def _world_batches(self, branches: _Branches, spec: _LoopSpec) -> dict[tuple[bool, bool], list]:
        """`_world_groups` with their K/V buffers: per step kind, (request rows, K/V buffers, RoPE, attention op, drop
        the controls). Built once per request (the loop's prologue)."""
        self.kv_arena.rewind()
        count, tokens = spec.controls
        drop = (count - 1) * tokens  # keys a control pass leaves out: the other controls'
        return {kind: [([s.request for s in seqs], *self.kv_arena.buffers(seqs, 0 if free else drop), free)
                       for seqs, free in groups]
                for kind, groups in self._world_groups(branches, spec).items()}

    def _replay(self, x_v, x_s, static, branches: _Branches, spec: _LoopSpec, *, on_step, on_segment=None):
        key = self._world_key(x_v, x_s, branches, spec)
        entry = self.graphs.get(key)
        if entry is None:
            with CaptureTimer(self.device, self._graph_pool_handle()) as timer:
                entry = self._capture_world(x_v, x_s, static, branches, spec, between=on_segment)
            entry.seconds, entry.pool = timer.seconds, self._graph_pool
            entry.nbytes = tensor_bytes(entry.inputs, entry.outputs)
            self.graphs.add(key, entry)
        ins = entry.inputs
        dst_tensors = [ins["x_v"], *ins["static"].values()]
        src_tensors = [x_v, *static.values()]
        if x_s is not None:
            dst_tensors.append(ins["x_s"])
            src_tensors.append(x_s)
        for dst, src in zip(ins["seqs"].all, branches.all, strict=True):
            out, into = copy_lists(dst.kv, src.kv)
            dst_tensors += out + [dst.rope.cos, dst.rope.sin]
            src_tensors += into + [src.rope.cos, src.rope.sin]
        torch._foreach_copy_(dst_tensors, src_tensors)
        steps = len(entry.graph)
        for i, segments in enumerate(entry.graph):
            for j, segment in enumerate(segments):
                segment.replay()
                if on_segment is not None and j + 1 < len(segments):
                    self._sync()  # a yield must leave no queued segment in front of the policy request
                    on_segment()
            if on_step is not None:
                self._sync()  # progress means done; and a yield must leave no queued step in front of others
                on_step(i, steps)
        assert entry.outputs is not None
        x_v_out, x_s_out = entry.outputs
        return x_v_out.clone(), None if x_s_out is None else x_s_out.clone()

    def _capture_world(self, x_v, x_s, static, branches: _Branches, spec: _LoopSpec, *,
                       between: Callable[[], None] | None = None) -> CapturedGraph:
        entry = CapturedGraph()
        seqs = _Branches(*([clone_branch(s) for s in part] for part in (branches.conds, branches.unconds,
                                                                         branches.nocontrols)))
        ins = {"x_v": x_v.clone(), "x_s": None if x_s is None else x_s.clone(), "seqs": seqs,
               "static": {k: v.clone() for k, v in static.items()}}
        entry.inputs = ins

        def new_loop() -> _WorldLoop:
            return _WorldLoop(self, ins["x_v"], ins["x_s"], ins["static"], seqs, spec)

        # The K/V buffers come from the arena shared with every other bucket of this engine (see Engine._capture);
        # replays of two buckets never interleave (one world request at a time per engine).
        arena = self.kv_arena.reserve([b for groups in self._world_groups(branches, spec).values() for b, _ in groups])
        with self.kv_arena.allocating():
            loop = self._record_segments(new_loop, len(spec.timesteps), between)
        entry.graph = loop.graphs
        entry.outputs = (loop.x_v, loop.x_s)
        # Every tensor a segment hands to the next lives in the graph pool and is referenced here.
        entry.keepalive = (spec, loop, arena)
        return entry

    def _record_segments(self, new_loop: Callable[[], _WorldLoop], steps: int,
                         between: Callable[[], None] | None = None) -> _WorldLoop:
        """Warm up one step of each kind (compile, autotune, cuDNN plans happen there), then capture every
        segment (a step, or a part of one: `step_segments`) as its own graph in the pool all graphs share, in
        replay order. The state one segment leaves for the next (latents, solver history, a step's hidden states
        between its segments) is referenced by the loop object (or the step's paused generator) while the next is
        captured, so a later capture only reuses memory already let go of; replays in capture order then never
        overwrite a tensor that is still to be read. Returns the loop with `graphs` set. (The only CUDA-specific
        step: CPU tests stand in for it.)

        `between` (a server's `on_segment`) runs after every warm-up step and every captured segment, outside
        any capture, with the device idle: a new shape's capture (5.9 s for Nano i2v at 12 segments a step) then
        holds policy requests up for its longest piece, the first warm-up step with its compile, not the whole.
        Other engines' work in those gaps stays out of this graph pool.

        The warm-up and the captures hold the process's capture turn (`ops.capture_turn`: the server's background
        ladder may be capturing a policy graph meanwhile); `between` runs with the turn let go, and while another
        thread holds it this thread runs `between` instead of blocking the policy batches waiting on it."""
        pool = self._graph_pool_handle()

        with capture_turn(wait=between) as turn:
            def pause() -> None:
                self._sync()
                with turn.let_go():
                    between()

            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    warm = new_loop()
                    kinds = warm.spec.kinds
                    for i in range(1 + max(kinds.index(k) for k in set(kinds))):
                        warm.step(i)  # up to the first step of the last kind to appear (guided / unguided)
                        if between is not None:
                            pause()
                    del warm
            torch.cuda.current_stream(self.device).wait_stream(side)
            loop = new_loop()
            for i in range(steps):
                pieces, graphs, finished = loop.pieces(i), [], False
                while not finished:
                    graph = torch.cuda.CUDAGraph()
                    with graph_capture(graph, pool=pool):
                        try:
                            next(pieces)
                        except StopIteration:
                            finished = True
                    graphs.append(graph)
                    if between is not None:
                        pause()
                loop.graphs.append(graphs)
        return loop
