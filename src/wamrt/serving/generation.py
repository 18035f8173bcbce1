"""World-generation jobs (text/image/video -> video, optionally with sound; text -> image) for `/v1/videos`,
`/v1/videos/sync` and `/v1/images/generations`, with vLLM-Omni's request fields.

Sampler. A checkpoint runs `wamrt.pipeline.world.run_world` (UniPC with CFG), or, when it is a distilled one,
`wamrt.pipeline.world_distilled.run_world_distilled` (its own few-step schedule, guidance baked in). Which one
is decided once, at startup, by `generation_settings.resolve_sampler` (`wamrt serve --sampler`, default: from
the checkpoint folder) and held by `WorldModel.schedule`; `build_generation` reads the request fields for that
sampler.

Scheduling. Generation runs on its own thread (`GenerationWorker`, one job at a time, its own bounded
queue of `max_generation_jobs`), and shares the device with the policy queue through the batcher's
`DeviceGate`: it holds the device for one segment at a time (prefill plus the first denoising step, each
further step, each latent frame of the VAE decode, the sound decode) and between segments (the pipelines'
`on_step`, the decoder's per-frame hook) it gives the device up for as long as any policy request is queued or
running. On CUDA servers the `WorldEngine` splits every step further into `--generation-step-segments` graphs of
consecutive layers and yields between them too (`on_segment`), so a 480p step of ~190 ms is ~16 ms segments.
So a policy request waits at most one generation segment, and a video job never takes a slot of the policy
queue. The same `on_step` reports progress and stops a cancelled job (DELETE, or its /sync client left)
between steps; the job's tensors go with the unwound stack.

Requests are validated before a job exists (`generation_request.build_generation`); the model side is
`world_model.WorldModel`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..pipeline.errors import RequestError
from .batcher import DeviceGate, GenerationCancelled
from .errors import Busy, Cancelled, NotReady, ServingError, as_serving_error
from .generation_request import GenerationRequest, Kind
from .media import audio_rate, encode_mp4, encode_png
from .world_model import WorldModel

log = logging.getLogger("wamrt.serving")
# AutoencoderKLWan's per-call conv caches (diffusers 0.42.1 `clear_cache`): decoder, then encoder.
_WAN_DECODE_STATE = ("_conv_num", "_conv_idx", "_feat_map", "_enc_conv_num", "_enc_conv_idx", "_enc_feat_map")



class _SoundWithYield:
    """The sound decoder with a yield point before its decode, so that the VAE's last frames and the sound
    decode are separate segments."""

    def __init__(self, inner: Any, before: Callable[[], None]) -> None:
        self._inner, self._before = inner, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, latents: Any) -> Any:
        self._before()
        return self._inner.decode(latents)


@dataclass
class GenerationOutcome:
    request_id: str
    kind: Kind
    mp4: bytes | None  # video jobs
    pngs: list[bytes]  # image jobs
    shape: list[int]  # [T, H, W, 3] of one output
    fps: float
    audio: dict[str, Any] | None  # {sample_rate, channels, seconds} of the MP4's AAC track
    seed: int
    mode: str  # text2video / image2video / video2video / text2image
    # queue_ms, model_ms (running, less paused_ms), paused_ms (waiting for policy work), postprocess_ms, total_ms,
    # segment_max_ms (the longest stretch a policy request arriving then had to wait for the device)
    timing: dict[str, float]
    stage_durations: dict[str, float]  # seconds
    notes: list[str]
    upsampled: dict[str, Any] | None = None  # upsample_prompt: {prompt (the caption used), source, note}


class GenerationJob:
    """One queued or running generation: its request, a future for the outcome, a cancel flag."""

    def __init__(self, request: GenerationRequest, request_id: str,
                 on_progress: Callable[..., None] | None = None) -> None:
        self.request, self.request_id, self.on_progress = request, request_id, on_progress
        self.future: Future = Future()
        self.enqueued = time.monotonic()
        self._cancel = threading.Event()
        self.shutdown_reason: str | None = None  # cancelled by a server shutdown: the job answers not_ready

    def cancelled(self) -> bool:
        return self._cancel.is_set()


def _allocator_retries(device: Any) -> int:
    import torch

    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


class GenerationWorker:
    """The generation thread: jobs one at a time, each step holding the device only while no policy work waits."""

    def __init__(self, world: WorldModel, gate: DeviceGate, *, max_jobs: int,
                 upsampler: Callable[..., Any] | None = None) -> None:
        if max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")
        self.world, self.gate, self.max_jobs = world, gate, max_jobs
        self.upsampler = upsampler  # serving.upsampling.Upsampler: `upsample_prompt` jobs, None without a Reasoner
        self._pending: deque[GenerationJob] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.running: GenerationJob | None = None
        self.jobs_run = 0
        # Longest stretch of device work between two points where generation could yield (a policy request
        # waits at most this long for the device).
        self.segment_max_ms = 0.0
        # Device time generation held, in segments (exported on /metrics: how much of the device generation got
        # next to policy traffic, also while no job finishes).
        self.segments, self.device_seconds = 0, 0.0
        # diffusers' Wan VAE decodes one latent frame per call of `vae.decoder`: a pre-hook there lets a long
        # decode give the device up between frames as the denoising loop does between steps.
        self._decode_yield: Callable[[], None] | None = None
        vae = getattr(world.encoder, "vae", None)
        decoder = getattr(vae, "decoder", None)
        self._hook = None
        if hasattr(decoder, "register_forward_pre_hook") and hasattr(vae, "clear_cache"):
            self._hook = decoder.register_forward_pre_hook(self._between_decoded_frames)
        self._thread = threading.Thread(target=self._loop, name="wamrt-generate", daemon=True)
        self._thread.start()

    def _between_decoded_frames(self, _module: Any, _args: Any) -> None:
        fn = self._decode_yield
        if fn is not None and threading.get_ident() == self._thread.ident:  # not the engine thread's FD decode
            fn()

    @property
    def depth(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, Any]:
        """What /metrics exports (`Metrics.watch_generation`)."""
        return {"jobs": self.jobs_run, "segments": self.segments, "device_seconds": self.device_seconds,
                "segment_max_seconds": self.segment_max_ms / 1e3, "running": int(self.running is not None),
                "queued": self.depth}

    def submit(self, job: GenerationJob) -> Future:
        with self._cond:
            if self._stopped:
                raise NotReady("server is shutting down")
            if len(self._pending) + (self.running is not None) >= self.max_jobs:
                raise Busy(f"{self.max_jobs} generation jobs queued or running (--max-generation-jobs); retry later")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, job: GenerationJob) -> None:
        """Stop a job: a queued one leaves the queue now, a running one at its next step boundary."""
        job._cancel.set()
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return  # running (it stops itself) or already finished
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(Cancelled("job cancelled"))

    def cancel_queued(self, reason: str) -> None:
        """Shutdown: every queued job ends now, answering not_ready with `reason`."""
        with self._cond:
            leftover = list(self._pending)
            self._pending.clear()
        for job in leftover:
            job.shutdown_reason = reason
            job._cancel.set()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(NotReady(reason))

    def cancel_running(self, reason: str) -> None:
        """Shutdown: the running job stops at its next step boundary, answering not_ready with `reason`."""
        job = self.running
        if job is not None:
            job.shutdown_reason = reason
            job._cancel.set()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopped = True
            leftover, running = list(self._pending), self.running
            self._pending.clear()
            self._cond.notify_all()
        for job in leftover:
            job._cancel.set()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(NotReady("server is shutting down"))
        if running is not None:
            running._cancel.set()
        self._thread.join(timeout)
        if self._hook is not None:
            self._hook.remove()

    # --- generation thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self.running = self._pending.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None
                self.jobs_run += 1
                del job  # hold nothing of a finished job while waiting for the next

    def _run(self, job: GenerationJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            outcome = self._generate(job)
        except GenerationCancelled:
            # A fresh exception: the caught one's traceback would keep the unwound frames (and their tensors).
            reason = job.shutdown_reason
            job.future.set_exception(NotReady(reason) if reason else Cancelled("job cancelled"))
        except Exception as exc:  # noqa: BLE001  # the job's own error goes to its caller, typed
            if not isinstance(exc, ServingError | RequestError):
                log.exception("generation job %s failed", job.request_id)
            err = as_serving_error(exc)
            err.__traceback__ = err.__context__ = err.__cause__ = None
            job.future.set_exception(err)
        else:
            job.future.set_result(outcome)

    def _generate(self, job: GenerationJob) -> GenerationOutcome:
        import torch

        from ..pipeline.omni import model_device
        req, world, gate = job.request, self.world, self.gate
        started = time.monotonic()
        seed = req.seed if req.seed is not None else int(np.random.default_rng().integers(0, 2**31))
        total_steps, done, paused = req.steps * req.count * req.chunks, 0, 0.0
        chunk = {"chunk": 1, "chunks": req.chunks}  # a long video's chunk, in the job's progress detail
        held, seg_start = False, 0.0
        job_segment_max = 0.0  # this job's longest segment (the reply's timing.segment_max_ms)
        # Where the job's longest segment began and ended ("start -> prepared", "step 3 -> step 4 segment", ...):
        # the reply's timing.segment_max_span, so a long wait for the device names the stretch of work to split.
        point, job_segment_span = "start", ""

        def acquire(cancellable: bool = True) -> None:
            """Wait until no policy work is queued or running, then hold the device for one segment."""
            nonlocal held, paused, seg_start
            t0 = time.monotonic()
            gate.acquire_generation(job.cancelled if cancellable else lambda: False)
            held, seg_start = True, time.monotonic()
            paused += seg_start - t0

        def yield_point(at: str) -> None:
            """Device work since the last point where a waiting policy request could have taken over (`at`: where
            this one is)."""
            nonlocal seg_start, job_segment_max, point, job_segment_span
            now = time.monotonic()
            if 1e3 * (now - seg_start) > job_segment_max:
                job_segment_max, job_segment_span = 1e3 * (now - seg_start), f"{point} -> {at}"
            point = at
            self.segment_max_ms = max(self.segment_max_ms, job_segment_max)
            self.segments += 1
            self.device_seconds += now - seg_start
            seg_start = now

        def release(at: str) -> None:
            nonlocal held
            yield_point(at)
            gate.release_generation()
            held = False

        def on_step(_i: int, _n: int) -> None:
            nonlocal done
            done += 1
            if job.on_progress is not None:  # 100 only once the output is encoded
                job.on_progress(int(100 * done / (total_steps + 1)), chunk if req.chunks > 1 else None)
            release(f"step {done}")  # a segment ends here: waiting policy batches run now
            acquire()  # raises GenerationCancelled when the job was cancelled meanwhile

        vae = getattr(world.encoder, "vae", None)
        device = model_device(world.model)
        on_cuda = device.type == "cuda"
        # The caching allocator's retries (a cudaMalloc that failed, every cached block freed, the device synchronized,
        # tried again: hundreds of ms) during this job: the reply's timing.allocator_retries, one candidate for a
        # segment far longer than its work.
        retries0 = _allocator_retries(device)

        def decode_yield(keep_vae_cache: bool = True, at: str = "decoded frame") -> None:
            """Between two latent frames of the VAE decode (see `_between_decoded_frames`), before the sound
            decode and, with `keep_vae_cache=False`, between two segments of one denoising step (the engine's
            `step_segments`; the step's state stays in the engine's graph buffers meanwhile): the device goes to
            policy work only while some waits.

            The device's queue is drained first: kernels launch asynchronously, and the VAE decode's host side runs
            frames ahead of the GPU. Without the wait, a policy request let in here queued behind the frames already
            launched, and the segment measured on the host was the wrong one: a job beside a paced lane showed
            "decoded frame -> done" segments of ~300 ms, the decode's backlog drained by the final host copy, and the
            lane's p99 1.49x its solo p99 (H100, 1200085). Inside a step the engine has drained it already."""
            if on_cuda:
                torch.cuda.current_stream(device).synchronize()
            if job.cancelled():  # still holding the device: drop a half-built cache, then stop
                if keep_vae_cache:
                    vae.clear_cache()
                raise GenerationCancelled("cancelled")
            if not gate.demand:
                yield_point(at)
                return
            # The VAE is shared with the policy path, whose encode resets the decoder's per-frame feature cache
            # (`clear_cache`): keep this decode's cache and put it back before going on (output bit-exact).
            saved = {name: getattr(vae, name) for name in _WAN_DECODE_STATE if keep_vae_cache and hasattr(vae, name)}
            release(at)
            # A kept cache must be restored under the device; cancel is then checked at the next frame.
            acquire(cancellable=not keep_vae_cache)
            for name, value in saved.items():
                setattr(vae, name, value)

        sound = None
        if req.sound:
            sound = _SoundWithYield(world.sound, lambda: decode_yield(keep_vae_cache=False, at="sound"))

        def mid_step() -> None:
            decode_yield(keep_vae_cache=False, at=f"step {done + 1} segment")

        def between_stages(stage: str) -> None:
            """Between the stages of a request (prepared, Reasoner prefilled, denoised): no decode in progress."""
            decode_yield(keep_vae_cache=False, at=stage)

        def on_chunk(k: int, _n: int) -> None:
            chunk["chunk"] = k + 1

        if job.on_progress is not None:
            job.on_progress(0)  # started
        upsampled, upsample_s = None, 0.0
        if req.upsample and self.upsampler is not None:
            # On the Reasoner's thread, which takes the device between policy batches as this job does; this job holds
            # no segment meanwhile.
            t_up = time.monotonic()
            up = self.upsampler(req.kind, req.kwargs, job.cancelled)
            req.kwargs["prompt"], upsampled = up.caption, up.as_dict()
            upsample_s = time.monotonic() - t_up
        outputs: list[tuple[np.ndarray, np.ndarray | None]] = []
        stages: dict[str, float] = {"upsample": upsample_s} if upsampled else {}
        run_notes: list[str] = []  # what the runs themselves report (a tiled decode), once each
        mode = "text2image"
        self._decode_yield = decode_yield if self._hook is not None else None
        try:
            for k in range(req.count):
                acquire()
                generator = torch.Generator().manual_seed(seed + k)
                extra = {"sound_decoder": sound} if world.schedule is None else {}  # distilled: no sound
                if req.chunks > 1:
                    extra["on_chunk"] = on_chunk
                result = world.run(**req.kwargs, **extra, generator=generator, on_step=on_step, on_segment=mid_step,
                                   on_stage=between_stages)
                release("done")
                assert result.frames is not None
                outputs.append((result.frames.numpy(),
                                None if result.sound is None else result.sound.numpy()))
                for key, ms in result.timings_ms.items():
                    stages[key] = stages.get(key, 0.0) + ms / 1e3
                run_notes += [n for n in result.notes if n not in run_notes]
                del result
        finally:
            self._decode_yield = None
            if held:
                release("stopped")
        if req.kwargs.get("controls"):
            mode = "transfer"
        elif req.kwargs.get("video") is not None:
            mode = "video2video"
        elif req.kwargs.get("image") is not None:
            mode = "image2video"
        elif req.kwargs["num_frames"] > 1:
            mode = "text2video"
        model_s = time.monotonic() - started - paused

        t0 = time.monotonic()
        mp4, pngs, audio = None, [], None
        frames, wave = outputs[0]
        if req.kind == "image":
            pngs = [encode_png(f[0]) for f, _ in outputs]
        else:
            rate = world.sound.sampling_rate if wave is not None else None
            # x264 threads: one on a CPU-only server (the cores run the model), FFmpeg's choice next to a GPU.
            threads = 0 if model_device(world.model).type == "cuda" else 1
            mp4 = encode_mp4(frames, req.fps, wave, rate, threads=threads)
            if wave is not None:
                assert rate is not None
                audio = {"sample_rate": audio_rate(rate), "decoder_sample_rate": rate, "channels": min(2, len(wave)),
                         "seconds": wave.shape[1] / rate}
        post_ms = 1e3 * (time.monotonic() - t0)
        stages["encode"] = post_ms / 1e3
        total_ms = 1e3 * (time.monotonic() - job.enqueued)
        timing = {"queue_ms": 1e3 * (started - job.enqueued), "model_ms": 1e3 * model_s, "paused_ms": 1e3 * paused,
                  "postprocess_ms": post_ms, "total_ms": total_ms, "segment_max_ms": job_segment_max,
                  "segment_max_span": job_segment_span}
        if on_cuda:
            timing["allocator_retries"] = _allocator_retries(device) - retries0
        notes = list(req.notes) + run_notes + ([upsampled["note"]] if upsampled and "note" in upsampled else [])
        return GenerationOutcome(job.request_id, req.kind, mp4, pngs, list(frames.shape), req.fps, audio, seed, mode,
                                 timing, stages, notes, upsampled)

