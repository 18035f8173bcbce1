"""`Engine`: the fast path for DROID policy requests on one GPU.

load -> fuse (Generator q/k/v, gate/up) -> compile the repeated layer halves -> capture the whole
denoising loop (every step, the sampler included) as one CUDA graph per shape bucket -> replay.

Each technique is a switch in `EngineConfig`, so the latency waterfall (E0 ... E5) runs the same
code with more of them on. Every configuration computes the same function as the eager reference
(`wamrt.pipeline.denoise`) up to bf16 rounding; tests hold it to that.

A batch's way in (seeds, validation, canvases, the frame-0 VAE encode, tokens) is `admission.py`; what a server
needs beyond one batch (per-thread state, encoder warm-up, out-of-memory reruns) is `served.py`; graph capture is
`graph_capture.py` and `graph_ladder.py`. This file is the denoising loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Generator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..model import Cosmos3Transformer, GeneratorOutput, GeneratorTokens, Rope
from ..model.attention import control_attention
from ..ops.attention import (
    BackendAttention,
    diffusers_gqa_attention,
    fa4_available,
    zero_key_attention_problem,
)
from ..ops.capture_turn import prime_compiler_for_threads
from ..pipeline.denoise import DenoiseInputs, DenoiseResult, SamplingOptions
from ..pipeline.droid import (
    OBSERVED_LATENT_FRAMES,
    ActionChunk,
    DroidContract,
    PreparedDroid,
    droid_actions,
    droid_metadata,
)
from ..pipeline.policy import Policy, device_name, validate_options
from ..pipeline.prefix import ActionAnchor, apply_anchor, empty_anchor
from ..pipeline.tokens import CaptionTokenizer
from ..pipeline.vae import FrameEncoder
from ..sampler import cfg_combine, euler_plan, guidance_active, unipc_plan
from .admission import RequestAdmission
from .config import EngineConfig, check_config
from .generator_pass import read_rows, run_to_end, select_requests
from .graph_cache import GraphCache, device_memory_stats, graph_pool_bytes
from .graph_capture import GraphCapture
from .graph_ladder import BackgroundCapture
from .kv_buffers import BatchBranch, KVBufferArena, KVBuffers
from .layer_path import CUBLASLT_WORKSPACE_ENV, LayerPath, build_layer_path, use_workspace_free_gemms
from .prefix_cache import PaddedPrefixes, ReasonerCache
from .served import Served
from .stage_clock import StageClock
from .vae_encode import FirstFrameEncoder

log = logging.getLogger(__name__)

ROPE_CACHE_SIZE = 64  # packing layouts (instruction length x geometry) whose Generator RoPE tables are kept


class Engine(RequestAdmission, GraphCapture, BackgroundCapture, Served):
    def __init__(
        self,
        model: Cosmos3Transformer,
        encoder: FrameEncoder,
        tokenizer: CaptionTokenizer,
        contract: DroidContract = DroidContract(),
        options: SamplingOptions = SamplingOptions(),
        config: EngineConfig = EngineConfig(),
        name: str = "",
        quantization: str | None = None,
    ) -> None:
        prime_compiler_for_threads()  # built before the threads that compile and run beside each other
        self.model, self.encoder, self.tokenizer = model, encoder, tokenizer
        self._canvas_encoder = (FirstFrameEncoder(encoder, capture=config.cuda_graph, row_ladder=config.batch_ladder)
                                if config.vae_encode == "first-frame" else encoder)
        self.contract, self.options, self.config, self.name = contract, options, config, name
        self.quantization = quantization  # the `wamrt quantize` recipe of the weights, if any (metadata)
        self.device = next(model.parameters()).device
        # Checked before anything touches the shared model (fusing swaps its layers' classes).
        if config.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs a CUDA device")
        check_config(config)
        if config.attention == "fa4" and not fa4_available(self.device):
            raise ValueError("attention='fa4' needs flash-attn-4 installed and a Hopper or Blackwell GPU")
        self.kv_cache = ReasonerCache(model, config.kv_cache_size, config.kv_cache_bytes)
        self.padded_prefixes = PaddedPrefixes(config.kv_cache_size, self.device, config.kv_cache_bytes)  # buckets
        self.graphs = GraphCache(config.graph_cache_size, config.graph_cache_bytes)
        self._graph_pool = None  # shared by every captured graph (see _capture)
        self._capture_lock = threading.RLock()  # one capture at a time (warm-up, or the background thread)
        self._local = threading.local()  # per thread: which layer path runs, the step kinds a loop needs
        self._capture_worker = None  # graph_ladder.CaptureWorker, made when a bucket is first wanted
        self.out_of_memory = {"retried": 0, "refused": 0}  # requests rerun alone after an OOM / answered with it
        self._init_admission()  # seeds, noise, host threads, the encode stream (admission.py)
        self._plans: dict[tuple, Any] = {}
        self._ropes: OrderedDict[tuple, Rope] = OrderedDict()  # Generator RoPE per packing layout (LRU)
        self._backend = BackendAttention(generator=config.attention if config.attention != "gqa" else "auto")
        if config.workspace_free_gemms and self.device.type == "cuda":
            use_workspace_free_gemms()
        path = build_layer_path(model, config, self.device)  # which kernels run each piece of a Generator pass
        self._embed, self._pre, self._post, self._finish, self._rescale = (path.embed, path.pre, path.post,
                                                                           path.finish, path.rescale)
        self._eager_path: LayerPath | None = None  # the same pieces uncompiled (see uncompiled)
        self.head_epilogue, self.fp8_triton_gemms, self.fp8_fast_accum = (path.head_epilogue, path.fp8_triton_gemms,
                                                                          path.fp8_fast_accum)
        # what runs: "auto" resolved here, bucket_attention may fall back to "mask" (below)
        self.cfg_attention = config.cfg_attention
        if self.cfg_attention == "auto":
            self.cfg_attention = "lengths" if config.attention == "fa4" else "split"
        self.gqa_buffers = config.gqa_buffers if config.gqa_buffers is not None else config.attention == "fa4"
        self.bucket_attention = config.bucket_attention
        if config.prompt_bucket and config.bucket_attention == "lse" and self.device.type == "cuda":
            backend = config.attention if config.attention != "gqa" else "auto"
            problem = zero_key_attention_problem(self.device, model.dtype, backend)
            if problem:  # never a wrong answer: the masked kernel is slower, not different
                log.warning("prompt buckets: log-sum-exp attention unavailable on %s (%s); using the mask", backend,
                            problem)
                self.bucket_attention = "mask"

        # K/V buffers; those of captured graphs live in its arena, outside the graph pool (see _capture)
        self.kv_arena = KVBufferArena(model.config, self.device, layout=self.cfg_attention, grouped=self.gqa_buffers,
                                      backend=config.attention, bucket_attention=self.bucket_attention,
                                      rescale=self._rescale_here, shared=config.shared_kv_buffer)

    @classmethod
    def from_policy(cls, policy: Policy, config: EngineConfig = EngineConfig()) -> Engine:
        return cls(policy.model, policy.encoder, policy.tokenizer, policy.contract, policy.options, config,
                   name=policy.name, quantization=policy.quantization)

    # ---------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        engine = {k: getattr(self.config, k) for k in ("attention", "batch_cfg", "compile", "compile_mode",
                                                       "cuda_graph", "prompt_bucket", "prompt_width",
                                                       "isolate_requests", "overlap_encode",
                                                       "workspace_free_gemms", "last_layer_read_rows",
                                                       "shared_kv_buffer", "capture_on_request")}
        engine["batch_ladder"] = list(self.config.batch_ladder)
        engine["prompt_widths"] = self._width_rungs()
        engine["bucket_attention"] = self.bucket_attention  # the effective ones
        engine["cfg_attention"] = self.cfg_attention
        engine["head_epilogue"] = self.head_epilogue
        engine["gqa_buffers"] = self.gqa_buffers
        engine["fp8_triton_gemms"] = list(self.fp8_triton_gemms)
        engine["fp8_fast_accum"] = self.fp8_fast_accum
        engine["cublaslt_workspace_kib"] = os.environ.get(CUBLASLT_WORKSPACE_ENV)  # None: torch's default
        engine["graphs"] = [k.describe() for k in self.graphs]  # the captured buckets, least recently used first
        meta = droid_metadata(self.name, self.contract, self.options, guided_prefix=False)
        return {**meta, "quantization": self.quantization, "gpu": device_name(self.device), "engine": engine}

    def graph_stats(self) -> dict[str, Any]:
        """Captures (by cause), evictions, cache entries and their static inputs' bytes, capture seconds, how requests
        ran (`GraphCache.requests`), and the allocator's own size of the graph pool every graph shares, with the K/V
        arena's (the server's /metrics reads these)."""
        arena = self.kv_arena.arena
        return {**self.graphs.stats(), "pool_bytes": graph_pool_bytes(self.device, self._graph_pool),
                "pools": len(self.graphs.pools()),
                "arena_bytes": 0 if arena is None else arena.numel() * arena.element_size(),
                "capture": self.capture_progress(), "out_of_memory": dict(self.out_of_memory),
                "device": device_memory_stats(self.device)}

    def infer(self, observation: Mapping[str, Any], *, seed: int | None = None, **overrides: Any) -> ActionChunk:
        result = self.infer_batch([observation], seeds=[seed], **overrides)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def infer_batch(
        self, observations: list[Mapping[str, Any]], *, seeds: list[int | None] | None = None, **overrides: Any
    ) -> list[ActionChunk | Exception]:
        """Requests of one shape bucket in one pass. A bad request yields its error in its slot."""
        opts = self.options.updated(**overrides)
        validate_options(opts)
        t_start = time.perf_counter()
        with torch.inference_mode():
            admitted = self._admit(observations, seeds)
            results: list[ActionChunk | Exception] = admitted.results
            prepared = admitted.prepared
            batches = [[ip] for ip in prepared] if self.config.isolate_requests else [prepared] if prepared else []
            for batch in batches:
                finals, timings = self._denoise_guarded([p for _, p in batch], opts)
                for i, prep in batch:
                    prep.timings_ms["vae_encode"] = admitted.encode_ms(i)
                t0 = time.perf_counter()
                for (i, prep), final in zip(batch, finals, strict=True):
                    if isinstance(final, BaseException):  # out of device memory even alone
                        results[i] = final
                        continue
                    actions = droid_actions(DenoiseResult(*final), self.contract, prep.state)
                    if not np.isfinite(actions).all():
                        results[i] = FloatingPointError("the model produced non-finite actions")
                        continue
                    results[i] = ActionChunk(actions, prep.seed, prep.prompt, {**prep.timings_ms, **timings},
                                             prep.prefix_rows, prep.prefix_mode, list(prep.notes))
                post = 1e3 * (time.perf_counter() - t0)
                for i, _ in batch:
                    if isinstance(results[i], ActionChunk):
                        results[i].timings_ms["postprocess"] = post
            total = 1e3 * (time.perf_counter() - t_start)
            for r in results:
                if isinstance(r, ActionChunk):
                    r.timings_ms["total"] = total
        return results

    # ---------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        # The current stream, not the device: the engine's work is queued there (the encode stream joins it), and a
        # device-wide sync would wait for a background capture's warm-up runs too.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _denoise(self, preps: list[PreparedDroid], opts: SamplingOptions):
        schedule = opts.make_schedule()
        timesteps = schedule.timesteps.tolist()
        cfg_steps = (guidance_active(timesteps, opts.guidance_interval) if opts.guidance != 1.0
                     else [False] * len(timesteps))
        timings: dict[str, float] = {}
        inputs = [p.inputs for p in preps]
        if not self.config.reuse_reasoner:
            self._sync()
            t0 = time.perf_counter()
            finals = [self._reference_loop(inp, opts, timesteps, cfg_steps) for inp in inputs]
            self._sync()
            timings["reasoner_prefill"] = 0.0  # inside every forward
            timings["denoise"] = 1e3 * (time.perf_counter() - t0)
            return finals, timings

        clock = StageClock(self.device)  # no host sync between the stages: stage_clock.py
        if not self.config.overlap_encode:
            self._sync()
        clock.start("reasoner_prefill")
        exact = self._sequences(inputs, any(cfg_steps))
        conds, unconds = self._pad_prefixes(*exact) if self.config.prompt_bucket else exact
        clock.stop("reasoner_prefill")
        if not self.config.overlap_encode:
            self._sync()

        clock.start("denoise")
        x_v = torch.cat([inp.vision for inp in inputs])
        x_a = torch.cat([inp.action for inp in inputs])
        # Per-request device data a captured graph reads from its static inputs, refreshed on every replay: which
        # action rows are clean and the rows put back every step (a committed prefix; zeros without one), so one
        # graph serves every prefix length d and mode.
        anchor = ActionAnchor.cat([inp.action_anchor or empty_anchor(*x_a.shape[1:], self.device) for inp in inputs])
        static = dict(
            vision_noisy=torch.cat([inp.vision_noisy for inp in inputs]),
            action_noisy=torch.cat([inp.action_noisy for inp in inputs]),
            domain_ids=torch.cat([inp.domain_ids for inp in inputs]),
            anchor_value=anchor.value, anchor_delta=anchor.delta, anchor_mask=anchor.mask,
        )
        raw_dim = inputs[0].raw_action_dim
        plan = self._plan(opts)
        if self.config.cuda_graph:
            out = self._graph_loop(x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim,
                                   exact=exact)
        else:
            out = self._loop(x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim)
        clock.stop("denoise")
        self._prefetch_noise()
        self._sync()
        timings.update(clock.ms())
        finals = [(out[0][r : r + 1], out[1][r : r + 1]) for r in range(len(inputs))]
        return finals, timings

    def _sequences(self, inputs: list[DenoiseInputs], need_uncond: bool
                   ) -> tuple[list[BatchBranch], list[BatchBranch]]:
        """The CFG branches this engine runs: Reasoner K/V (cached per prompt) + Generator rope per request.
        (A subclass may run only some of them, e.g. one branch per GPU: wamrt.parallel.cfg.)"""
        conds = [self._branch(r, inp.cond) for r, inp in enumerate(inputs)]
        unconds: list[BatchBranch] = []
        if need_uncond:
            for r, inp in enumerate(inputs):
                assert inp.uncond is not None
                unconds.append(self._branch(r, inp.uncond))
        return conds, unconds

    def _branch(self, request: int, branch) -> BatchBranch:
        kv = self.kv_cache.get(branch.input_ids, branch.positions, branch.token_key)
        return BatchBranch(request, kv, self._generator_rope(branch))

    def _generator_rope(self, branch) -> Rope:
        """The Generator part of a branch's RoPE table, cached per packing layout (equal layouts have equal
        positions: `Branch.layout`); a few hundred microseconds of small kernels per branch and request otherwise."""
        key = branch.layout
        if key is None:
            return self.model.rope(branch.positions).split(branch.input_ids.shape[1])[1]
        rope = self._ropes.get(key)
        if rope is None:
            rope = self._ropes[key] = self.model.rope(branch.positions).split(branch.input_ids.shape[1])[1]
            while len(self._ropes) > ROPE_CACHE_SIZE:
                self._ropes.popitem(last=False)
        self._ropes.move_to_end(key)
        return rope

    def _bucket_lengths(self, conds: list[BatchBranch], unconds: list[BatchBranch]) -> tuple[int, ...]:
        """Prefix lengths that (with the shapes) identify a captured graph (padded ones with prompt buckets)."""
        return tuple(s.kv.length for s in conds + unconds)

    def _padded_length(self, tokens: int) -> int:
        b = self.config.prompt_bucket
        return -(-tokens // b) * b if b else tokens

    def _width_rungs(self) -> list[int]:
        """The prefix widths graphs are captured at (prompt buckets): `prompt_widths`, and `prompt_width`."""
        return sorted(set(self.config.prompt_widths) | ({self.config.prompt_width} if self.config.prompt_width
                                                         else set()))

    def _pad_prefixes(self, conds: list[BatchBranch], unconds: list[BatchBranch], width: int | None = None
                      ) -> tuple[list[BatchBranch], list[BatchBranch]]:
        """Every sequence's Reasoner K/V left-padded with zeros to one width (default: the batch's bucket, raised to
        the narrowest width rung that holds it), with a key mask marking its real tokens (see PaddedPrefixes)."""
        seqs = conds + unconds
        if not width:
            width = self._padded_length(max(s.kv.length for s in seqs))
            width = min((w for w in self._width_rungs() if w >= width), default=width)
        out = [BatchBranch(s.request, self.padded_prefixes.get(s.kv, width), s.rope) for s in seqs]
        return out[: len(conds)], out[len(conds):]

    def _plan(self, opts: SamplingOptions):
        """Solver coefficients per (schedule, steps, shift, solver), built once: building a UniPC plan
        costs a host sync, and a captured graph keeps reading the plan it was captured with."""
        key = (opts.schedule, opts.steps, opts.shift, opts.solver)
        plan = self._plans.get(key)
        if plan is None:
            schedule = opts.make_schedule()
            plan = unipc_plan(schedule, device=self.device) if opts.solver == "unipc" else euler_plan(schedule)
            self._plans[key] = plan
        return plan

    # The loop over steps, shared by the eager engine and graph capture --------------------------
    def _step_batches(self, conds: list[BatchBranch], unconds: list[BatchBranch], n: int) -> dict[bool, list]:
        """Per step kind (with / without CFG): the groups one Generator pass serves, each as (rows of the
        request batch, Reasoner K/V or K/V buffers, rope, attention op). Built once per request batch."""
        kinds: dict[bool, list] = {}
        self.kv_arena.rewind()
        for cfg_on in (False, True):
            seqs = conds + (unconds if cfg_on else [])
            if cfg_on and not unconds:
                continue
            if not cfg_on and unconds and self._kinds_needed == {True}:
                continue  # CFG at every step: a cond-only pass never runs, so no buffers for it
            if self.config.batch_cfg:
                kinds[cfg_on] = [([s.request for s in seqs], *self.kv_arena.buffers(seqs))]
            else:
                attn = self._backend if self.config.attention != "gqa" else diffusers_gqa_attention
                kinds[cfg_on] = [([s.request], s.kv, s.rope, attn) for s in seqs]
        return kinds

    def _loop_batches(self, conds: list[BatchBranch], unconds: list[BatchBranch], cfg_steps: list[bool]
                      ) -> list[list[BatchBranch]]:
        """The branch batches one loop builds K/V buffers for (see _step_batches)."""
        if unconds and all(cfg_steps):
            return [conds + unconds]
        return [conds] + ([conds + unconds] if unconds else [])

    def _generator_pieces(self, tok: GeneratorTokens, bufs: KVBuffers, rope: Rope, attn,
                          pause_after: Collection[int] = (), last_layer_rows: str = "all",
                          clean_frames: int = OBSERVED_LATENT_FRAMES) -> Generator[None, None, GeneratorOutput]:
        """One Generator pass that pauses (yields) after each layer index in `pause_after` and returns the
        output: a world request captures each of its long steps as several graphs this way, so that a server can
        hand the device to a policy request within a step (`WorldEngine(step_segments=...)`). `last_layer_rows`:
        which rows the last layer runs after its K/V stores, "all", "noisy" (not the `clean_frames` leading clean
        latent frames, whose velocity is zero: returned as zeros; a policy's observation, a world request's
        conditioning frames) or "action" (the output's vision is None); see `EngineConfig.last_layer_read_rows`.
        A transfer batch with several controls attends in one pass per control (`control_attention` over `attn`'s
        `per_pass` op: a `kv_buffers.ControlPassAttention`)."""
        embed, pre, post, finish = self._layer_pieces()
        g, update = embed(tok), None
        last, out_tok, clean = len(self.model.layers) - 1, tok, 0
        controls = tok.control_segments(self.model.config.latent_patch_size)
        if controls is not None and controls.count < 2:
            controls = None  # one control: ordinary attention
        for index, layer in enumerate(self.model.layers):
            kbuf, vbuf = bufs.layer(index)
            q, g = pre(layer, g, update, rope, kbuf, vbuf, bufs.start)
            if index == last and last_layer_rows != "all":
                q, g, out_tok, clean = read_rows(q, g, tok, last_layer_rows, self.model.config.latent_patch_size,
                                                 clean_frames)
            if controls is not None:
                o = control_attention(attn.per_pass, q, kbuf, vbuf, gen_at=bufs.start, seg=controls,
                                      control_queries=out_tok.controls is not None)
            else:
                o = attn(q, kbuf, vbuf, causal=False)
            g, update = post(layer, g, o)
            if index in pause_after:
                yield
        out = finish(g, update, out_tok)
        if clean:
            v = out.vision
            out = replace(out, vision=torch.cat([v.new_zeros(*v.shape[:2], clean, *v.shape[3:]), v], dim=2))
        return out

    def _generator_step(self, tok: GeneratorTokens, bufs: KVBuffers, rope: Rope, attn) -> GeneratorOutput:
        return run_to_end(self._generator_pieces(tok, bufs, rope, attn))

    def _velocities(self, groups: list, tok: GeneratorTokens, raw_dim: int | None,
                    last_layer_rows: str = "all") -> GeneratorOutput:
        """Velocities of every row of `groups` (see _step_batches), rows in group order; action columns from
        `raw_dim` on zeroed. `last_layer_rows` as `_generator_pieces`'s, where the passes run on K/V buffers."""
        return run_to_end(self._velocity_pieces(groups, tok, raw_dim, last_layer_rows=last_layer_rows))

    def _velocity_pieces(self, groups: list, tok: GeneratorTokens, raw_dim: int | None,
                         pause_after: Collection[int] = (), last_layer_rows: str = "all",
                         clean_frames: int = OBSERVED_LATENT_FRAMES) -> Generator[None, None, GeneratorOutput]:
        """`_velocities`, pausing after the layers in `pause_after` of each K/V-buffer group's pass."""
        outs = []
        if last_layer_rows != "all" and not all(isinstance(kv, KVBuffers) for _, kv, _, _ in groups):
            last_layer_rows = "all"  # the per-branch reference pattern (batch_cfg=False) runs the model's own pass
        for rows, kv, rope, attn in groups:
            sel = select_requests(tok, rows)
            if isinstance(kv, KVBuffers):
                outs.append((yield from self._generator_pieces(sel, kv, rope, attn, pause_after, last_layer_rows,
                                                               clean_frames)))
            else:
                self.model.attention = attn
                outs.append(self.model.generator_step(sel, rope, kv))

        def rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
            if parts[0] is None:
                return None
            return torch.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]

        vision, sound, action = (rows([getattr(o, f) for o in outs]) for f in ("vision", "sound", "action"))
        if raw_dim is not None and action is not None:
            cols = torch.arange(action.shape[-1], device=action.device) < raw_dim
            action = torch.where(cols, action, torch.zeros_like(action))
        return GeneratorOutput(vision, sound, action)

    def _loop(self, x_v, x_a, static, conds, unconds, plan, timesteps, cfg_steps, opts, raw_dim):
        dtype, n = self.model.dtype, x_v.shape[0]
        self._kinds_needed = set(cfg_steps)
        kinds = self._step_batches(conds, unconds, n)
        hist_v, hist_a = plan.init_history(), plan.init_history()
        last = len(timesteps) - 1
        masks = {k: static[k] for k in ("vision_noisy", "action_noisy", "domain_ids")}
        anchor = ActionAnchor(static["anchor_value"], static["anchor_delta"], static["anchor_mask"])
        sigmas = plan.schedule.sigmas.tolist()  # host floats (the schedule lives on the CPU)
        x_a = apply_anchor(x_a, anchor, sigmas[0])
        for i, t in enumerate(timesteps):
            tok = GeneratorTokens(timesteps=torch.full((n,), float(t), device=self.device), vision=x_v.to(dtype),
                                  action=x_a.to(dtype), **masks)
            rows = "all" if not self.config.last_layer_read_rows else "action" if i == last else "noisy"
            vel = self._velocities(kinds[cfg_steps[i]], tok, raw_dim, last_layer_rows=rows)
            v_vis, v_act = vel.vision, vel.action
            if cfg_steps[i]:
                v_act = cfg_combine(v_act[:n], v_act[n:], opts.guidance)
            if v_vis is not None:  # None: the last step of a pass that computed the action rows only
                if cfg_steps[i]:
                    v_vis = cfg_combine(v_vis[:n], v_vis[n:], opts.guidance)
                x_v, hist_v = plan.step(i, x_v, v_vis, hist_v)
            x_a, hist_a = plan.step(i, x_a, v_act, hist_a)
            if raw_dim is not None:
                x_a = torch.where(torch.arange(x_a.shape[-1], device=x_a.device) < raw_dim, x_a, 0.0)
            x_a = apply_anchor(x_a, anchor, sigmas[i + 1])
        return x_v, x_a

    # E0/E1: the reference call pattern (full forward per branch per step) --------------------------
    def _reference_loop(self, inp: DenoiseInputs, opts: SamplingOptions, timesteps, cfg_steps):
        model, dtype = self.model, self.model.dtype
        model.attention = diffusers_gqa_attention if self.config.attention == "gqa" else self._backend
        plan = self._plan(opts)
        x_v, x_a = inp.vision, inp.action
        hist_v, hist_a = plan.init_history(), plan.init_history()
        anchor, sigmas = inp.action_anchor, plan.schedule.sigmas.tolist()
        if anchor is not None:
            x_a = apply_anchor(x_a, anchor, sigmas[0])
        for i, t in enumerate(timesteps):
            tok = GeneratorTokens(timesteps=torch.full((1,), float(t), device=self.device), vision=x_v.to(dtype),
                                  vision_noisy=inp.vision_noisy, action=x_a.to(dtype), action_noisy=inp.action_noisy,
                                  domain_ids=inp.domain_ids)
            branches = [inp.cond] + ([inp.uncond] if cfg_steps[i] else [])
            outs = [model(b.input_ids, b.positions, tok) for b in branches]
            cols = torch.arange(x_a.shape[-1], device=self.device) < inp.raw_action_dim
            vel = [(o.vision, torch.where(cols, o.action, torch.zeros_like(o.action))) for o in outs]
            if cfg_steps[i]:
                v_vis = cfg_combine(vel[0][0], vel[1][0], opts.guidance)
                v_act = cfg_combine(vel[0][1], vel[1][1], opts.guidance)
            else:
                v_vis, v_act = vel[0]
            x_v, hist_v = plan.step(i, x_v, v_vis, hist_v)
            x_a, hist_a = plan.step(i, x_a, v_act, hist_a)
            x_a = torch.where(cols, x_a, 0.0)
            if anchor is not None:
                x_a = apply_anchor(x_a, anchor, sigmas[i + 1])
        return x_v, x_a

