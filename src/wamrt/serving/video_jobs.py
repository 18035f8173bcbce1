"""The `/v1/videos` job table (`VideoJobs`): records of queued, running and finished jobs (policy, dynamics, world
generation), their MP4s for `/content`, cancellation, and the record fields a finished job fills (shared with the
`/sync` replies in videos.py). Bounded: finished jobs go oldest-first beyond `--max-jobs` records or
MAX_CONTENT_BYTES of kept MP4s."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
import uuid
from collections import OrderedDict
from typing import Any

from starlette.requests import Request

from ..client.wire import to_jsonable
from .dynamics import DynamicsRequest
from .errors import Busy, Cancelled
from .generation import GenerationOutcome
from .generation_request import GenerationRequest
from .logs import log_request
from .media import encode_mp4
from .service import DynamicsOutcome, InferOutcome, Service

DROID_DOMAIN = ("droid_lerobot", 8)  # the embodiment a policy job's actions are reported in
UNFINISHED = ("queued", "in_progress")
MAX_CONTENT_BYTES = 2 * 2**30  # MP4s kept for /content (a 720p Nano clip is tens of MB): beyond, oldest jobs go


def _peak_memory_mb() -> float:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
    except ImportError:  # pragma: no cover
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _action(out: InferOutcome) -> dict[str, Any]:
    return {"data": out.actions.tolist(), "shape": list(out.actions.shape), "dtype": "float32",
            "raw_action_dim": int(out.actions.shape[1]), "action_mode": "policy", "domain_id": DROID_DOMAIN[1]}


async def dynamics_record(rec: dict[str, Any], out: DynamicsOutcome, req: DynamicsRequest) -> bytes | None:
    """Fill a job record from a FD/ID result; returns the MP4 (forward dynamics) encoded off the loop."""
    action = None
    if out.actions is not None:
        action = {"data": out.actions.tolist(), "shape": list(out.actions.shape), "dtype": "float32",
                  "raw_action_dim": req.raw_action_dim, "action_mode": out.mode, "domain_id": req.domain_id}
    mp4 = None
    if out.frames is not None:
        mp4 = await asyncio.to_thread(encode_mp4, out.frames, req.fps)
        rec.update(file_name=f"{rec.get('id') or out.request_id}.mp4",
                   video={"shape": list(out.frames.shape), "fps": req.fps, "bytes": len(mp4)})
    rec.update(status="completed", progress=100, completed_at=int(time.time()),
               inference_time_s=out.timing["total_ms"] / 1e3, stage_durations=out.stage_durations,
               peak_memory_mb=_peak_memory_mb(), action=action, timing=out.timing,
               metadata={"seed": out.seed, "action_mode": out.mode, "chunk_size": req.kwargs["chunk_size"],
                         "domain": req.kwargs["domain"], "resolution_tier": req.kwargs["resolution_tier"]})
    return mp4


def generation_record(rec: dict[str, Any], out: GenerationOutcome, req: GenerationRequest) -> None:
    """Fill a job record (or a sync reply's fields) from a finished generation."""
    kw = req.kwargs
    rec.update(status="completed", progress=100, completed_at=int(time.time()),
               inference_time_s=out.timing["total_ms"] / 1e3, stage_durations=out.stage_durations,
               peak_memory_mb=_peak_memory_mb(), action=None, timing=out.timing,
               file_name=f"{rec.get('id') or out.request_id}.mp4",
               video={"shape": out.shape, "fps": out.fps, "bytes": len(out.mp4 or b""), "audio": out.audio},
               metadata={"seed": out.seed, "mode": out.mode, "num_frames": kw["num_frames"], **req.sampling,
                         "sound": req.sound, **({"notes": out.notes} if out.notes else {}),
                         **({"upsampled_prompt": out.upsampled} if out.upsampled else {})})


class VideoJobs:
    """In-memory job table, bounded: finished jobs are evicted oldest-first beyond `max_jobs`."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.tasks: dict[str, asyncio.Task] = {}
        self.content: dict[str, bytes] = {}  # forward-dynamics / generation MP4s, dropped with their record
        self.makes_video: set[str] = set()  # jobs whose output is an MP4 (/content: 409 until completed)

    def _make_room(self) -> None:
        while len(self.records) >= self.service.config.max_jobs:
            done = next((k for k, r in self.records.items() if r["status"] not in UNFINISHED), None)
            if done is None:
                raise Busy(f"{len(self.records)} video jobs are unfinished; retry later")
            self.remove(done)

    def remove(self, vid: str) -> None:
        self.records.pop(vid, None)
        self.content.pop(vid, None)
        self.makes_video.discard(vid)

    def store(self, vid: str, mp4: bytes) -> None:
        """Keep a finished job's MP4; past MAX_CONTENT_BYTES in all, the oldest other finished jobs are evicted
        (record and content, as `max_jobs` evicts)."""
        if vid not in self.records:  # deleted meanwhile
            return
        self.content[vid] = mp4
        total = sum(map(len, self.content.values()))
        for old in [k for k in self.records if k != vid and k in self.content]:
            if total <= MAX_CONTENT_BYTES:
                break
            if self.records[old]["status"] not in UNFINISHED:
                total -= len(self.content[old])
                self.remove(old)

    def cancel(self, vid: str) -> None:
        """DELETE of an unfinished job: it ends as `cancelled` (a queued one never runs; a running generation
        stops at its next denoising step and frees its tensors; a running policy batch finishes, discarded)."""
        task = self.tasks.get(vid)
        if task is not None:
            task.cancel()
        self.content.pop(vid, None)
        self.records[vid].update(status="cancelled", completed_at=int(time.time()),
                                 error={"code": "cancelled", "message": "cancelled by DELETE"})

    def create(self, req: Any, extras: dict[str, Any]) -> dict[str, Any]:
        self._make_room()
        vid = f"video_gen_{uuid.uuid4().hex}"
        # Busy -> 429 before any record exists
        if isinstance(req, GenerationRequest):
            future: Any = self.service.enqueue_generation(req, request_id=vid, on_progress=self._progress(vid))
        elif isinstance(req, DynamicsRequest):
            future = self.service.enqueue_dynamics(req)
        else:
            future = self.service.enqueue(req)
        rec = {"id": vid, "object": "video", "model": extras["model"] or self.service.config.model_name,
               "prompt": extras["prompt"], "status": "queued", "progress": 0, "size": extras["size"],
               "seconds": extras["seconds"], "quality": "standard", "created_at": int(time.time()),
               "completed_at": None, "expires_at": None, "remixed_from_video_id": None, "error": None,
               "media_type": "video/mp4", "file_name": None, "inference_time_s": None, "stage_durations": None,
               "peak_memory_mb": None, "action": None}
        self.records[vid] = rec
        if isinstance(req, GenerationRequest) or (isinstance(req, DynamicsRequest) and req.mode == "forward_dynamics"):
            self.makes_video.add(vid)
        self.tasks[vid] = asyncio.ensure_future(self._run(vid, req, future))
        return rec

    def _progress(self, vid: str) -> Any:
        """A thread-safe progress hook for the generation thread: the record is only touched on the loop."""
        loop = asyncio.get_running_loop()

        def set_progress(value: int, detail: dict | None) -> None:
            rec = self.records.get(vid)
            if rec is not None and rec["status"] in UNFINISHED:
                rec.update(status="in_progress", progress=max(rec["progress"], value))
                if detail is not None:  # a long video's chunk: {"chunk": k, "chunks": n}
                    rec["progress_detail"] = dict(detail)

        def post(value: int, detail: dict | None = None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under a job stopped by shutdown
                loop.call_soon_threadsafe(set_progress, value, detail)

        return post

    async def _run(self, vid: str, req: Any, future: Any) -> None:
        rec, started, batch_size = self.records[vid], time.monotonic(), 1.0
        if not isinstance(req, GenerationRequest):  # a generation job says when it starts (progress 0)
            rec["status"] = "in_progress"
        try:
            if isinstance(req, GenerationRequest):
                gout = await self.service.run_generation(future, surface="videos")
                if rec["status"] in UNFINISHED:
                    generation_record(rec, gout, req)
                    self.store(vid, gout.mp4 or b"")
            elif isinstance(req, DynamicsRequest):
                dout = await self.service.run_dynamics(req, surface="videos", received=time.monotonic(),
                                                       request_id=vid, future=future)
                mp4 = await dynamics_record(rec, dout, req)
                if mp4 is not None:
                    self.store(vid, mp4)
            else:
                out = await self.service.infer(req, surface="videos", received=time.monotonic(), request_id=vid,
                                               future=future)
                self.fill(rec, out)
                batch_size = out.timing["batch_size"]
            log_request(self.service, "videos", vid, started, batch_size=batch_size)
        except asyncio.CancelledError:
            if rec["status"] in UNFINISHED:
                rec.update(status="cancelled", completed_at=int(time.time()),
                           error={"code": "cancelled", "message": "cancelled"})
            log_request(self.service, "videos", vid, started, error=Cancelled("cancelled"))
            raise
        except Cancelled as exc:
            rec.update(status="cancelled", completed_at=int(time.time()),
                       error={"code": exc.code, "message": exc.message})
            log_request(self.service, "videos", vid, started, error=exc)
        except Exception as exc:  # noqa: BLE001  # recorded on the job as a typed error
            err = self.service.count_error(exc)
            rec.update(status="failed", completed_at=int(time.time()), error={"code": err.code, "message": err.message})
            log_request(self.service, "videos", vid, started, error=err)
        finally:
            self.tasks.pop(vid, None)

    @staticmethod
    def fill(rec: dict[str, Any], out: InferOutcome) -> None:
        rec.update(status="completed", progress=100, completed_at=int(time.time()),
                   inference_time_s=out.timing["total_ms"] / 1e3, stage_durations=out.stage_durations,
                   peak_memory_mb=_peak_memory_mb(), action=_action(out), timing=out.timing,
                   metadata=to_jsonable(out.metadata))

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()


def jobs_of(request: Request) -> VideoJobs:
    return request.app.state.video_jobs
