"""The one engine behind every surface: batcher + warm-up + safety + timing + metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from ..pipeline.observation import JOINTS, PROMPT
from . import media
from .batcher import Batcher, BatchPolicy, BatchResult, Job
from .chat_worker import ChatWorker
from .config import ServeConfig
from .dynamics import DynamicsRequest, generic_runner
from .errors import Busy, InvalidRequest, NotReady, ServingError, as_serving_error, drop_tracebacks
from .generation import GenerationJob, GenerationOutcome, GenerationWorker
from .generation_request import GenerationRequest, build_generation
from .generation_settings import warmup_fields
from .heap import trim_periodically
from .limits import GenerationCost, check_prompt, unpack_msgpack
from .metrics import Metrics
from .observation import ParsedRequest, parse_request
from .safety import SafetyEnvelope
from .upsampling import Upsampler
from .world_model import world_model_of

log = logging.getLogger("wamrt.serving")
# Policy timing keys that are input preparation / output handling; everything else is model time.
_PRE_STAGES = ("preprocess", "tokenize", "pack")
_POST_STAGES = ("postprocess",)
# Parsing and decoding run on PARSE_THREADS threads; past MAX_PARSING requests being parsed at once, `busy` (429).
PARSE_THREADS, MAX_PARSING = 2, 64
# Freed heap pages go back to the system this often (heap.py). A trim costs ~1 ms; at 10 s the RSS swung by
# +-30 MB between trims (docs/serving.md, soak).
TRIM_INTERVAL_S = 1.0


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


@dataclass
class InferOutcome:
    request_id: str
    actions: np.ndarray  # [horizon, action_dim] float32, after the safety envelope
    seed: int
    timing: dict[str, float]  # queue_ms, preprocess_ms, model_ms, postprocess_ms, total_ms, batch_size
    metadata: dict[str, Any]
    stage_durations: dict[str, float] = field(default_factory=dict)  # seconds, per policy stage


@dataclass
class DynamicsOutcome:
    """A forward/inverse-dynamics result: actions (ID) or decoded frames (FD)."""

    request_id: str
    mode: str
    actions: np.ndarray | None  # [chunk, raw_action_dim] float32 (inverse dynamics)
    frames: np.ndarray | None  # uint8 [chunk + 1, H, W, 3] (forward dynamics)
    seed: int
    timing: dict[str, float]
    stage_durations: dict[str, float]


class Service:
    def __init__(self, policy: BatchPolicy, config: ServeConfig) -> None:
        self.policy, self.config = policy, config
        self.metrics = Metrics(config.max_batch)
        if hasattr(policy, "graph_stats"):  # the fast engine: CUDA-graph cache metrics, read at scrape time
            self.metrics.watch_graphs(policy.graph_stats)
        self.safety = SafetyEnvelope.load(config.safety_file) if config.safety_file else None
        self.defaults = config.sampler_defaults()
        self.batcher: Batcher | None = None
        self.ready = False
        self.warmup_error: str | None = None
        # Called once warm-up has failed: `wamrt serve` stops the process (exit status 1, the error in one line)
        # rather than stay up and never ready; a ServerThread raises instead.
        self.on_warmup_failure: Callable[[], None] | None = None
        self.warmup_seconds: float | None = None  # until /readyz turned 200
        self.startup_info: dict[str, Any] | None = None  # what `wamrt serve` loaded (startup.load): the summary line
        self._graph_watch: asyncio.Future | None = None
        self._policy_meta = policy.metadata()
        self.metrics.build_info(version=__version__, model=config.model_name,
                                recipe=self._policy_meta.get("quantization"))
        self.connections: set[Any] = set()  # open websocket connections (openpi_ws registers them)
        self.generic = generic_runner(policy)  # forward/inverse dynamics; None if the engine has no generic path
        # World generation (text/image/video -> video, text -> image) on the served checkpoint; None if the
        # engine exposes no model/VAE/tokenizer. Its sound tokenizer is loaded here when the transformer has
        # sound heads and the checkpoint ships one, and its sampler (UniPC or distilled) is decided here.
        self.world = world_model_of(policy, config.model_name, config.sampler,
                                    step_segments=config.generation_step_segments)
        self.generation: GenerationWorker | None = None
        # The Reasoner as a chat model (lm_head, and the vision tower when the checkpoint ships one); None with the
        # reason when the checkpoint cannot speak (no lm_head, no chat template) or chat is off (--chat-max-batch 0).
        self.reasoner, self.reasoner_note = None, "chat is off (--chat-max-batch 0)"
        if config.chat_max_batch:
            from ..reasoner.load import reasoner_of

            self.reasoner, self.reasoner_note = reasoner_of(policy, config.model_name, max_len=config.chat_context)
        self.chat: ChatWorker | None = None
        self._tokenizer = getattr(policy, "tokenizer", None)
        # The caption template's own tokens, counted once: an instruction's tokens are its caption's minus these.
        self._template_tokens = len(self._tokenizer.encode("").text_ids) if self._tokenizer is not None else 0
        self.limits = config.limits(self._policy_meta.get("num_steps"))
        # World generation's step-time model (a FLOP count of the checkpoint against a measured device rate).
        self.cost = None if self.world is None else GenerationCost.of(
            self.world.model, max_step_ms=config.max_step_ms, max_job_s=config.max_job_s,
            step_segments=config.generation_step_segments)
        self._pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="wamrt-parse")
        self._parsing = 0
        self.draining = False  # SIGTERM: new work gets not_ready (503); accepted work finishes (`drain`)
        self._stop_trim = threading.Event()
        self._last_readiness = "warming up"

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        trim_periodically(TRIM_INTERVAL_S, self._stop_trim)  # flat RSS (heap.py)
        self.batcher = Batcher(self.policy, max_batch=self.config.max_batch, max_wait_ms=self.config.max_wait_ms,
                               max_queue=self.config.max_queue, observer=self.metrics)
        if self.reasoner is not None:  # its own thread and queue, the device shared the same way
            self.chat = ChatWorker(self.reasoner, self.batcher.gate, max_batch=self.config.chat_max_batch,
                                   max_queue=self.config.chat_max_queue, on_first_token=self.metrics.first_token,
                                   precapture_when=self._idle_captures_allowed,
                                   one_row=self.config.chat_decode == "one-row")
            self.metrics.watch_chat(self.chat.stats)
        if self.world is not None:  # its own thread and queue; the device is shared through the batcher's gate
            self.generation = GenerationWorker(self.world, self.batcher.gate,
                                               max_jobs=self.config.max_generation_jobs,
                                               upsampler=self.chat and Upsampler(self.chat, self.config))
            self.metrics.watch_generation(self.generation.stats)

    def _idle_captures_allowed(self) -> bool:
        """Chat's decode graphs may be captured ahead of use once the server is ready and the policy engine's own
        background captures are done (no two capture streams at once)."""
        progress = getattr(self.policy, "capture_progress", None)
        return self.ready and (progress is None or bool(progress()["complete"]))

    def _captures_in_background(self) -> bool:
        """A CUDA-graph engine that captures off the request path (`EngineConfig.capture_on_request=False`)."""
        engine = self._policy_meta.get("engine") or {}
        return (bool(engine.get("cuda_graph")) and engine.get("capture_on_request") is False
                and not engine.get("isolate_requests") and hasattr(self.policy, "plan_ladder"))

    async def warm_up(self) -> None:
        """Run the configured warm-up requests through the real path; /readyz turns 200 afterwards."""
        started = time.monotonic()
        try:
            assert self.batcher is not None
            background = self._captures_in_background()
            if background:
                await self._warm_up_in_background()
            else:
                await self._warm_up_capturing()
            for text in self.config.generation_warmup:
                await self.warm_up_generation(text)
            if background:
                # The ladder starts after the generation warm-up jobs: a job's captures and the ladder's take turns
                # (ops.capture_turn), and a ladder graph's compile holds the turn ~20 s at Nano, so started first it
                # put ~40 s on the i2v warm-up's readiness (H100: warm-up 43.9 s alone, 80.9-90.9 s beside it).
                self.policy.plan_ladder()
                self._graph_watch = asyncio.ensure_future(self._watch_captures())
            self.warmup_seconds = round(time.monotonic() - started, 1)
            self.ready = True
            if self.startup_info is not None:
                from .startup import summary_line

                log.info("%s", summary_line(self.startup_info, self.warmup_state()))
        except Exception as exc:  # /readyz reports it; `wamrt serve` then stops (on_warmup_failure)
            field = getattr(exc, "field", None)  # a --generation-warmup job the server refuses names its field
            self.warmup_error = f"{type(exc).__name__}: {f'{field}: ' if field else ''}{exc}"
            if field:  # the operator's request, refused: its one line says what to change
                log.error("warm-up failed: %s", self.warmup_error)
            else:  # a fault of ours: the traceback is the bug report
                log.exception("warm-up failed")
            if self.on_warmup_failure is not None:
                self.on_warmup_failure()

    async def _warm_up_in_background(self) -> None:
        """Ready in seconds: the frame-0 encode's graphs at every batch size, then warm-up requests, which run
        uncaptured; the CUDA graphs of the batch ladder at every prefix width are captured afterwards on the engine's
        background thread (`warm_up` starts it), while requests run on the graphs captured so far or uncaptured
        (never waiting)."""
        from ..sample import sample_observation

        assert self.batcher is not None
        sizes = range(1, self.config.max_batch + 1)
        await self.batcher.run(Job({}, None, {}, task=lambda: self.policy.warm_up_encoder(sample_observation(0),
                                                                                          sizes)))
        for i in range(max(1, self.config.warmup_requests)):
            await self.batcher.run(Job(sample_observation(i), 0, dict(self.defaults)))

    async def _watch_captures(self) -> None:
        while not self.policy.capture_progress()["complete"]:
            await asyncio.sleep(1.0)
        progress = self.policy.capture_progress()
        log.info("CUDA graphs: %d of %d planned captured in the background in %s s (%d failed)",
                 progress["captured"], progress["planned"], progress["seconds"], progress["failed"])

    def warmup_state(self) -> dict[str, Any]:
        """What /readyz reports of the warm-up: its seconds, and the background captures' progress."""
        out: dict[str, Any] = {"seconds": self.warmup_seconds}
        if hasattr(self.policy, "capture_progress"):
            out["graphs"] = self.policy.capture_progress()
        return out

    def public_warmup_state(self) -> dict[str, Any]:
        """`warmup_state` for the open /readyz: counts and seconds, no error text."""
        out = self.warmup_state()
        if "graphs" in out:
            out["graphs"] = {k: v for k, v in out["graphs"].items() if k != "errors"}
        return out

    async def _warm_up_capturing(self) -> None:
        """Capture on the request path, before ready (isolated requests, `--capture-on-request`)."""
        from ..sample import sample_observation

        assert self.batcher is not None
        exact = getattr(self.policy, "capturing_exact_buckets", contextlib.nullcontext)
        with exact():
            if (self._policy_meta.get("engine") or {}).get("cuda_graph"):
                # The engine captures one CUDA graph per batch size on first use: submit k requests at
                # once for every k up to max_batch so the batcher forms those batches now, before the
                # first lanes arrive, rather than stalling them with captures. Largest first: the first
                # capture then sizes the K/V arena every later graph shares. With a declared prompt width
                # (--prompt-width) the engine pads these batches to it, so these are the graphs every
                # instruction up to that width, in any mix, replays later.
                for k in range(self.config.max_batch, 1, -1):
                    await asyncio.gather(*(self.batcher.run(Job(sample_observation(j), 0, dict(self.defaults)))
                                           for j in range(k)))
            for i in range(self.config.warmup_requests):
                await self.batcher.run(Job(sample_observation(i), 0, dict(self.defaults)))

    async def warm_up_generation(self, text: str) -> None:
        """One `--generation-warmup` job through the generation thread (the path requests take), unmetered."""
        fields = await asyncio.to_thread(warmup_fields, text)
        req = await asyncio.to_thread(build_generation, fields, self.world, max_pixels=self.config.max_video_pixels,
                                      model_name=self.config.model_name, limits=self.limits, cost=self.cost)
        job = self.enqueue_generation(req, request_id=new_request_id("gen-warmup"))
        started = time.monotonic()
        await asyncio.wrap_future(job.future)
        log.info("generation warm-up %s x %s frames: %.1f s", req.record["size"], req.kwargs["num_frames"],
                 time.monotonic() - started)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop_trim.set()
        if self._graph_watch is not None:
            self._graph_watch.cancel()
        if self.generation:
            self.generation.stop(timeout)
        if self.chat:
            self.chat.stop(timeout)
        if self.batcher:
            self.batcher.stop(timeout)
        if hasattr(self.policy, "stop_background_capture"):
            self.policy.stop_background_capture()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- parsing: every decode and check of a request body runs here, off the event loop ---------------
    async def offload(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the parse pool: the event loop keeps answering probes and other lanes meanwhile."""
        if self._parsing >= MAX_PARSING:
            raise Busy(f"{MAX_PARSING} requests are being parsed; retry later")
        self._parsing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._parsing -= 1

    def policy_frame(self, frame: bytes) -> ParsedRequest:
        """One msgpack frame (websocket or `/v1/policy/infer`) -> a checked request (parse pool)."""
        return self.policy_request(unpack_msgpack(frame, self.limits))

    def policy_request(self, msg: Any) -> ParsedRequest:
        """A decoded observation map -> a checked request (parse pool)."""
        req = parse_request(msg, limits=self.limits)
        self.check_policy(req)
        return req

    def check_policy(self, req: ParsedRequest) -> None:
        """The bounds that need the served model: prompt tokens by its tokenizer, steps by --max-policy-steps."""
        if req.endpoint == "reset":
            return
        check_prompt(req.observation[PROMPT], PROMPT, self._tokenizer, self.limits.instruction_tokens,
                     flag="--max-prompt-tokens", template_tokens=self._template_tokens)
        steps = req.overrides.get("steps")
        if steps is not None and steps > self.limits.policy_steps:
            raise InvalidRequest(f"{steps} steps is over this server's {self.limits.policy_steps} "
                                 "(--max-policy-steps)", field="params.steps")

    # --- readiness and drain ------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): warmed up, not draining, the queue not full, no batch or generation segment
        running past --ready-stall-s. A change is logged (the open /readyz says only ready or not)."""
        ready, why = self._readiness()
        if why != self._last_readiness:
            (log.info if ready else log.warning)("readiness: %s", why)
            self._last_readiness = why
        return ready, why

    def _readiness(self) -> tuple[bool, str]:
        if not self.ready:
            return False, "warm-up failed" if self.warmup_error else "warming up"
        if self.draining:
            return False, "shutting down"
        assert self.batcher is not None
        if self.batcher.depth >= self.config.max_queue:
            return False, "queue full"
        now, stall = time.monotonic(), self.config.ready_stall_s
        for name, since in (("engine", self.batcher.running_since), ("generation", self.batcher.gate.generation_since)):
            if since is not None and now - since > stall:
                return False, f"{name} busy for {now - since:.0f} s (over --ready-stall-s {stall:g})"
        return True, "ready"

    async def drain(self, deadline: float) -> None:
        """SIGTERM: new work is refused (not_ready, 503); queued and running policy work finishes; queued
        generation jobs are cancelled now and a running one at half the remaining time (each answering
        not_ready); returns when nothing is left or at `deadline` (time.monotonic())."""
        self.draining = True
        cancel_generation_at = time.monotonic() + (deadline - time.monotonic()) / 2
        if self.generation is not None:
            self.generation.cancel_queued("server is shutting down")
        while time.monotonic() < deadline:
            policy_busy = self.batcher is not None and (self.batcher.depth or self.batcher.in_flight)
            generating = self.generation is not None and self.generation.running is not None
            if generating and time.monotonic() >= cancel_generation_at:
                assert self.generation is not None
                self.generation.cancel_running("server is shutting down")
            replying = any(getattr(c, "busy", False) for c in self.connections)
            if not (policy_busy or generating or replying):
                return
            await asyncio.sleep(0.02)

    # --- metadata ----------------------------------------------------------------------------------
    def handshake(self) -> dict[str, Any]:
        """Superset of the openpi / RoboArena / vLLM-Omni handshake fields (protocols.md §12.1)."""
        pm = self._policy_meta
        if hasattr(self.policy, "graph_stats"):  # the buckets captured so far (the startup copy predates warm-up)
            pm = {**pm, "engine": {**pm.get("engine", {}), "graphs": self.policy.metadata()["engine"]["graphs"]}}
        d = {"steps": pm.get("num_steps"), "guidance": pm.get("guidance"), "shift": pm.get("shift"),
                "guidance_interval": pm.get("guidance_interval"), **self.defaults}
        gi = d.get("guidance_interval")
        return {
            "image_resolution": [360, 640], "composite_resolution": list(pm.get("image_size", [540, 640])),
            "n_external_cameras": 2, "needs_wrist_camera": True, "needs_stereo_camera": False,
            "needs_session_id": True, "action_space": "joint_position",
            "action_horizon": pm.get("action_horizon", 32), "action_dim": pm.get("action_dim", 8),
            "control_hz": pm.get("control_hz", 15.0), "model": self.config.model_name or pm.get("model", ""),
            "server": f"wamrt/{__version__}",
            "sampler": {"num_steps": d["steps"], "guidance": d["guidance"], "shift": d["shift"],
                        "guidance_interval": list(gi) if gi else None},
            "max_batch": self.config.max_batch, "max_frame_bytes": self.config.max_frame_bytes,
            "safety_envelope": self.safety is not None, "policy": pm,
            "mp4": media.has_pyav(),  # False: MP4 requests (/v1/videos generation and dynamics, chat videos) get a 501
            "reasoner": self.reasoner.describe() if self.reasoner is not None else {"chat": False,
                                                                                   "note": self.reasoner_note},
            **self.config.extra_metadata,
        }

    # --- inference ---------------------------------------------------------------------------------
    def prompt_tokens(self, caption: str) -> int | None:
        """Token count of a request's conditional Reasoner prefix (its caption plus the template and the
        two closing tokens): what prompt buckets pad, so clients can see which lengths a server ran. The
        engine does not return it, so it is asked of the policy's own tokenizer, whose `CaptionTokenizer` cache
        already holds the caption the engine just encoded. None if the policy exposes no tokenizer."""
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(caption).text_ids)

    def accepting(self) -> None:
        """Raise NotReady unless new work is taken (engine started, no shutdown drain)."""
        if self.batcher is None:
            raise NotReady("engine not started")
        if self.draining:
            raise NotReady("server is shutting down")

    def enqueue(self, req: ParsedRequest) -> Future:
        """Queue one request now (raises Busy at once when the queue is full)."""
        self.accepting()
        job = Job(req.observation, req.seed, {**self.defaults, **req.overrides}, deadline=req.deadline)
        return self.batcher.submit(job)

    async def infer(self, req: ParsedRequest, *, surface: str, received: float, request_id: str | None = None,
                    future: Future | None = None) -> InferOutcome:
        """One request through the batcher. `received` = time.monotonic() when its bytes arrived;
        `future` = an already `enqueue`d job. Cancelling the caller drops a job that has not started."""
        rid = request_id or new_request_id()
        parsed_at = time.monotonic()
        res: BatchResult = await asyncio.wrap_future(future or self.enqueue(req))
        if self.config.added_latency_ms:  # --added-latency-ms: the reply waits, the batcher does not
            await asyncio.sleep(self.config.added_latency_ms / 1e3)
        t0 = time.monotonic()
        chunk = res.chunk
        tm = chunk.timings_ms
        pre = sum(tm.get(k, 0.0) for k in _PRE_STAGES)
        post = sum(tm.get(k, 0.0) for k in _POST_STAGES)
        model = max(tm.get("total", res.batch_ms) - pre - post, 0.0)
        actions = np.asarray(chunk.actions, dtype=np.float32)
        meta: dict[str, Any] = {"session_id": req.session_id, "seed": chunk.seed, "horizon": actions.shape[0],
                                "action_dim": actions.shape[1], "valid_steps": actions.shape[0]}
        tokens = self.prompt_tokens(chunk.prompt)
        if tokens is not None:
            meta["prompt_tokens"] = tokens
        notes = list(dict.fromkeys([*req.notes, *getattr(chunk, "notes", ())]))  # the parse's, then the policy's
        if notes:
            meta["notes"] = notes
        if getattr(chunk, "prefix_rows", 0):  # rows 0..d-1 repeat the committed rows the request carried
            meta["action_prefix"] = {"rows": chunk.prefix_rows, "mode": chunk.prefix_mode}
        if self.safety is not None:
            state = np.asarray(req.observation[JOINTS], dtype=np.float64).reshape(-1, 7)[-1]
            try:
                actions, report = self.safety.apply(actions, state, req.embodiment)
            except ServingError:
                self.metrics.safety.labels("reject").inc()
                raise
            if report.clamped:
                self.metrics.safety.labels("clamp").inc()
            meta["safety"] = report.as_dict()
        post += 1e3 * (time.monotonic() - t0)
        timing = {"queue_ms": res.queue_ms, "preprocess_ms": pre + 1e3 * (parsed_at - received),
                  "model_ms": model, "postprocess_ms": post, "batch_ms": res.batch_ms,
                  "batch_size": float(res.batch_size), "total_ms": 1e3 * (time.monotonic() - received)}
        self.metrics.timing(surface, timing)
        stages = {k: v / 1e3 for k, v in tm.items()}
        return InferOutcome(rid, actions, chunk.seed, timing, meta, stages)

    def enqueue_dynamics(self, req: DynamicsRequest) -> Future:
        """Queue one FD/ID request: it runs alone on the engine thread (raises Busy when the queue is full)."""
        self.accepting()
        runner = self.generic
        if runner is None:
            raise InvalidRequest("this engine serves action_mode 'policy' only", field="extra_params.action_mode")

        def task() -> tuple[Any, int]:
            import torch

            seed = req.seed
            if seed is None:
                seed = self.policy.next_seed() if hasattr(self.policy, "next_seed") else int(
                    np.random.default_rng().integers(0, 2**31))
            gen = torch.Generator().manual_seed(seed)
            return runner(req.mode, **req.kwargs, generator=gen, decode=req.mode == "forward_dynamics"), seed

        return self.batcher.submit(Job({}, None, {}, task=task))

    async def run_dynamics(self, req: DynamicsRequest, *, surface: str, received: float,
                           request_id: str | None = None, future: Future | None = None) -> DynamicsOutcome:
        """One FD/ID request through the engine queue; cancelling the caller drops it if still queued."""
        rid = request_id or new_request_id()
        res: BatchResult = await asyncio.wrap_future(future or self.enqueue_dynamics(req))
        result, seed = res.chunk
        tm = dict(result.timings_ms)
        pre = sum(tm.get(k, 0.0) for k in ("preprocess", "vae_encode", "tokenize"))
        post = tm.get("vae_decode", 0.0)
        model = max(tm.get("total", res.batch_ms) - pre - post, 0.0)
        actions = frames = None
        if result.actions is not None:
            actions = np.asarray(result.actions, dtype=np.float32)
            if not np.isfinite(actions).all():
                raise FloatingPointError("the model produced non-finite actions")
        if result.frames is not None:
            frames = np.asarray(result.frames)
        timing = {"queue_ms": res.queue_ms, "preprocess_ms": pre, "model_ms": model, "postprocess_ms": post,
                  "batch_ms": res.batch_ms, "batch_size": 1.0, "total_ms": 1e3 * (time.monotonic() - received)}
        self.metrics.timing(surface, timing)
        return DynamicsOutcome(rid, req.mode, actions, frames, seed, timing, {k: v / 1e3 for k, v in tm.items()})

    def enqueue_generation(self, req: GenerationRequest, *, request_id: str | None = None,
                           on_progress: Any = None) -> GenerationJob:
        """Queue one world-generation job on the generation thread (raises Busy when its queue is full)."""
        if self.generation is None:
            self.accepting()
            raise InvalidRequest("this engine has no world-generation path", field="model")
        self.accepting()
        if req.upsample and self.chat is None:
            raise InvalidRequest(f"the served checkpoint cannot upsample prompts: {self.reasoner_note}",
                                 field="upsample_prompt")
        job = GenerationJob(req, request_id or new_request_id("gen"), on_progress)
        self.generation.submit(job)
        return job

    async def run_generation(self, job: GenerationJob, *, surface: str) -> GenerationOutcome:
        """Await a queued generation job. Cancelling the caller cancels the job: a queued one leaves the queue,
        a running one stops at its next denoising step and drops its tensors."""
        try:
            out: GenerationOutcome = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            assert self.generation is not None
            self.generation.cancel(job)
            raise
        self.metrics.timing(surface, out.timing)
        return out

    async def generate(self, req: GenerationRequest, *, surface: str,
                       request_id: str | None = None) -> GenerationOutcome:
        return await self.run_generation(self.enqueue_generation(req, request_id=request_id), surface=surface)

    def count_error(self, exc: BaseException) -> ServingError:
        """`exc` as the typed error the client gets, counted; an internal failure is logged with its traceback.
        The tracebacks are dropped then (`drop_tracebacks`): the request's body is freed with its handler."""
        err = as_serving_error(exc)
        self.metrics.errors.labels(err.code).inc()
        if type(err) is ServingError:  # an internal failure: log it, the client only gets the type
            log.error("internal error: %r", exc, exc_info=exc)
        drop_tracebacks(exc)
        drop_tracebacks(err)
        return err

