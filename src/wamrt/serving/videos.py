"""vLLM-Omni-compatible `/v1/videos` jobs for policy requests (protocols.md §2.2, §2.3, §12.2).

`POST /v1/videos` (multipart form or JSON) queues a job and answers its `VideoResponse` record;
clients poll `GET /v1/videos/{id}` until `completed`, then read `action {data, shape, dtype,
raw_action_dim, action_mode, domain_id}`, `inference_time_s`, `stage_durations`, `peak_memory_mb`.
`POST /v1/videos/sync` answers the finished record's JSON form at once (this runtime renders no MP4,
so `/content` is empty for policy and inverse-dynamics jobs, as vLLM-Omni's is for action-only outputs;
forward-dynamics jobs serve their predicted frames there as an MP4).

The observation comes from `extra_params.robot_obs` (alias `observation`; openpi keys, arrays as
nested lists or `{"b64", "dtype", "shape"}`), or from an `input_reference` image (the 540x640
composite) plus `extra_params.action` = the current [7 joints, gripper] state. `extra_params.action_prefix` [d, 8] and
`action_prefix_mode` (or the same keys in robot_obs) carry a moving robot's committed rows (wamrt.pipeline.prefix).

`extra_params.action_mode` `forward_dynamics` / `inverse_dynamics` run the generic contracts instead
(`dynamics.py`): FD answers an MP4 of the predicted frames at `/content`, ID the actions in `action`.

A request with no `action_mode` and none of the policy's inputs (`POLICY_KEYS`: robot_obs / observation,
the `action` state, domain, chunk, session) is world generation (`generation.py`, vLLM-Omni's T2V / I2V /
V2V with optional sound): the job reports `progress` per denoising step, `/content` serves the MP4 (H.264,
AAC when there is sound), and DELETE of an unfinished job cancels it between steps.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..client.wire import decode_image, json_array
from ..pipeline.controls import HINT_KEYS
from ..pipeline.observation import GRIPPER, IMAGE, JOINTS, PROMPT
from ..pipeline.prefix import PREFIX_KEY, PREFIX_MODE_KEY, parse_action_prefix
from .body import parse_fields, read_body
from .dynamics import DYNAMICS_MODES, DynamicsRequest, _data_url, build_dynamics
from .errors import Conflict, InvalidRequest, NotFound
from .fields import as_float, as_int
from .generation_request import GenerationRequest, build_generation
from .http_api import error_response, service_of, until_disconnect
from .limits import DEFAULT_LIMITS, Limits, loads_json
from .logs import log_request, logged_reply
from .media import require_pyav
from .observation import parse_params, parse_request
from .service import Service, new_request_id
from .video_jobs import (
    DROID_DOMAIN,
    UNFINISHED,
    VideoJobs,
    dynamics_record,
    generation_record,
    jobs_of,
)

PREFIX_KEYS = (PREFIX_KEY, PREFIX_MODE_KEY)  # optional keys of the observation contract, also in extra_params

GENERATE = "generate"  # the routing mode of world-generation requests (they carry no action_mode)
# extra_params keys that only a policy request carries: with any of them (and no action_mode) a request is a
# policy request, as before world generation existed; without, and without action_mode, it is generation.
POLICY_KEYS = ("robot_obs", "observation", "action", "session_id", "domain_name", "domain_id", "raw_action_dim",
               "action_chunk_size", "guidance_interval", *PREFIX_KEYS)
REPEATED_FIELDS = ("control_reference", "control_type")  # one per uploaded transfer control, in order
_TOP_LEVEL_PARAMS = {"num_inference_steps": "steps", "guidance_scale": "guidance", "flow_shift": "shift"}


def _json_field(value: Any, name: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    return loads_json(value, field=name, limits=limits) if isinstance(value, str) else value


async def _read_fields(request: Request, service: Service) -> dict[str, Any]:
    """The request's fields: the body read under its byte and time bounds, parsed in the parse pool."""
    body = await read_body(request, service.limits)
    return await service.offload(form_fields, body, request.headers.get("content-type"), service.limits)


def form_fields(body: bytes, content_type: str | None, limits: Limits) -> dict[str, Any]:
    """`body.parse_fields` with this API's repeated fields (one per transfer control) and its file count: the
    input_reference and one control_reference per transfer hint."""
    return parse_fields(body, content_type, limits, repeated=REPEATED_FIELDS, max_files=1 + len(HINT_KEYS))


def _mode(fields: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> tuple[str, dict[str, Any], str]:
    """(prompt, extra_params, mode) with typed errors for each. mode: `extra_params.action_mode` when given
    (policy / forward_dynamics / inverse_dynamics); else policy when a policy input is present (POLICY_KEYS),
    else GENERATE."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("is required", field="prompt")
    extra = _json_field(fields.get("extra_params") or {}, "extra_params", limits)
    if not isinstance(extra, dict):
        raise InvalidRequest("must be a JSON object", field="extra_params")
    transfer = [k for k in HINT_KEYS if k in extra] or (["control_reference"] if fields.get("control_reference")
                                                         else [])
    if transfer and ("action_mode" in extra or any(k in extra for k in POLICY_KEYS)):
        name = "extra_params.action_mode" if "action_mode" in extra else \
            f"extra_params.{next(k for k in POLICY_KEYS if k in extra)}"
        raise InvalidRequest(f"video transfer ({transfer[0]}) does not combine with actions", field=name)
    if "action_mode" not in extra:
        return prompt, extra, "policy" if any(k in extra for k in POLICY_KEYS) else GENERATE
    mode = extra["action_mode"]
    if mode != "policy" and mode not in DYNAMICS_MODES:
        raise InvalidRequest(f"must be one of {['policy', *DYNAMICS_MODES]}, got {mode!r}",
                             field="extra_params.action_mode")
    return prompt, extra, mode


async def read_job(request: Request, service: Service) -> tuple[Any, dict[str, Any]]:
    """The request's body -> (ParsedRequest | DynamicsRequest | GenerationRequest, job-record extras): read
    under its bounds, then parsed, decoded and checked in the parse pool (`parse_job`)."""
    body = await read_body(request, service.limits)
    return await service.offload(parse_job, body, request.headers.get("content-type"), service)


def parse_job(body: bytes, content_type: str | None, service: Service) -> tuple[Any, dict[str, Any]]:
    """Body -> (request, job-record extras), every check made; CPU work (tokenizing, video decoding, frame
    conversion), so it runs in the parse pool."""
    fields = form_fields(body, content_type, service.limits)
    _prompt, extra, mode = _mode(fields, service.limits)
    if mode == "policy":
        req, record = build_request(fields, service.limits)
        service.check_policy(req)
        return req, record
    # every other mode answers with MP4 (dynamics and transfer also read it): refused before any decoding
    require_pyav("extra_params.action_mode" if mode != GENERATE else "prompt")
    if mode == GENERATE:
        cfg = service.config
        greq = build_generation(fields, service.world, kind="video", max_pixels=cfg.max_video_pixels,
                                model_name=cfg.model_name, limits=service.limits, cost=service.cost)
        return greq, greq.record
    dreq = build_dynamics(fields, extra, mode, service.defaults, limits=service.limits,
                          tokenizer=getattr(service.policy, "tokenizer", None))
    return dreq, dreq.record


def build_request(fields: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> tuple[Any, dict[str, Any]]:
    """Form/JSON fields of an `action_mode: policy` request -> (ParsedRequest, job-record extras)."""
    prompt, extra, mode = _mode(fields, limits)
    if mode != "policy":
        raise InvalidRequest(f"expected action_mode 'policy', got {mode!r}", field="extra_params.action_mode")
    if extra.get("domain_name", DROID_DOMAIN[0]) != DROID_DOMAIN[0] or extra.get("domain_id", 8) != 8:
        raise InvalidRequest("only the droid_lerobot domain (8) is served", field="extra_params.domain_name")
    for name, want in (("action_chunk_size", 32), ("raw_action_dim", 8)):
        if name in extra and extra[name] != want:
            raise InvalidRequest(f"must be {want} for this policy", field=f"extra_params.{name}")
    robot = extra.get("robot_obs", extra.get("observation"))
    obs: dict[str, Any] = {}
    if robot is not None:
        if not isinstance(robot, dict):
            raise InvalidRequest("must be an object with openpi keys", field="extra_params.robot_obs")
        obs = {k: json_array(v, k, max_pixels=limits.image_pixels) if k not in ("prompt", "session_id") else v
               for k, v in robot.items()}
    for name in ("input_reference", "image_reference"):
        if name in fields and fields[name] in ("", b""):
            raise InvalidRequest("is empty", field=name)
    name = "input_reference" if fields.get("input_reference") else "image_reference"
    image = fields.get(name)
    if isinstance(image, str):  # image_reference = JSON {"image_url": "data:image/png;base64,..."}
        image = _data_url(image, name, "image_url")
    if isinstance(image, bytes | bytearray) and IMAGE not in obs:
        obs[IMAGE] = decode_image(bytes(image), name, limits.image_pixels)
    if "action" in extra and JOINTS not in obs:  # TensorRT-LLM style: the current 8-value state
        try:
            state = np.asarray(extra["action"], dtype=np.float32).reshape(-1)
        except (TypeError, ValueError, OverflowError):
            state = np.zeros(0, np.float32)
        if state.shape != (8,):
            raise InvalidRequest("must be the 8-value state [7 joints, gripper]", field="extra_params.action")
        obs[JOINTS], obs[GRIPPER] = state[:7], state[7:]
    obs.setdefault(PROMPT, prompt)
    # The committed rows of a robot that keeps moving (wamrt.pipeline.prefix): extra_params.action_prefix [d, 8]
    # and action_prefix_mode, or the same keys inside robot_obs.
    given = [k for k in PREFIX_KEYS if k in extra and k not in obs]
    for key in given:
        obs[key] = json_array(extra[key], key) if key == PREFIX_KEY else extra[key]
    if given:
        try:
            parse_action_prefix(obs)
        except ValueError as exc:
            field = getattr(exc, "field", None)
            raise InvalidRequest(str(exc).removeprefix(f"{field}: "), field=f"extra_params.{field}") from exc
    if "session_id" in extra:
        obs["session_id"] = extra["session_id"]
    params: dict[str, Any] = {}
    for key, param in _TOP_LEVEL_PARAMS.items():
        if fields.get(key) not in (None, ""):
            params[param] = as_int(fields[key], key, 1, 1000) if param == "steps" else as_float(fields[key], key)
    for key in ("num_steps", "guidance", "shift", "guidance_interval"):
        if key in extra:
            params[key] = extra[key]
    if params:
        obs["params"] = params
    if fields.get("seed") not in (None, ""):
        obs["seed"] = as_int(fields["seed"], "seed", 0, 2**63 - 1)
    parse_params(obs.get("params"))  # early, typed errors for bad sampler values
    record = {"model": fields.get("model"), "prompt": prompt, "size": fields.get("size") or "640x540",
              "seconds": str(fields.get("seconds") or "4")}
    return parse_request(obs, limits=limits), record


def _headers(service: Service, rid: str, rec: dict[str, Any], stages: dict[str, float],
             timing: dict[str, float] | None = None) -> dict[str, str]:
    headers = {"X-Request-Id": rid, "X-Model": service.config.model_name,
               "X-Inference-Time-S": f"{rec['inference_time_s']:.6f}", "X-Stage-Durations": json.dumps(stages),
               "X-Peak-Memory-MB": f"{rec['peak_memory_mb']:.1f}"}
    if timing is not None:
        # The JSON form's `timing` (queue / model / paused ms...) for clients that take the MP4 itself: a load
        # test reads it without asking for the video base64-encoded inside JSON, work the event loop would do.
        headers["X-Timing"] = json.dumps(timing)
    return headers


async def _guard(request: Request, work: Any, surface: str) -> Response:
    service, received = service_of(request), time.monotonic()
    try:
        return await work
    except Exception as exc:  # noqa: BLE001  # typed (4xx) or internal_error, never a traceback
        err, rid = service.count_error(exc), new_request_id(surface)
        log_request(service, surface, rid, received, error=err)
        return error_response(err, msgpack=False, request_id=rid)


async def create_video(request: Request) -> Response:
    async def work() -> Response:
        req, extras = await read_job(request, service_of(request))
        return JSONResponse(jobs_of(request).create(req, extras))
    return await _guard(request, work(), "videos")


async def create_video_sync(request: Request) -> Response:
    async def work() -> Response:
        service, received = service_of(request), time.monotonic()
        req, _extras = await read_job(request, service)
        if isinstance(req, DynamicsRequest):
            return logged_reply(service, "videos_sync", received, await _dynamics_sync(request, service, req))
        if isinstance(req, GenerationRequest):
            return logged_reply(service, "videos_sync", received, await _generation_sync(request, service, req))
        out = await until_disconnect(request, service.infer(req, surface="videos_sync", received=time.monotonic(),
                                                            request_id=new_request_id("video_sync")))
        rec: dict[str, Any] = {}
        VideoJobs.fill(rec, out)
        headers = {"X-Request-Id": out.request_id, "X-Model": service.config.model_name,
                   "X-Inference-Time-S": f"{rec['inference_time_s']:.6f}",
                   "X-Stage-Durations": json.dumps(out.stage_durations),
                   "X-Peak-Memory-MB": f"{rec['peak_memory_mb']:.1f}"}
        body = {"created": int(time.time()), "id": out.request_id,
                "data": [{"b64_json": None, "url": None, "revised_prompt": None, "action": rec["action"]}],
                "stage_durations": out.stage_durations, "peak_memory_mb": rec["peak_memory_mb"],
                "inference_time_s": rec["inference_time_s"], "timing": out.timing,
                "metadata": rec["metadata"]}
        return logged_reply(service, "videos_sync", received, JSONResponse(body, headers=headers),
                            batch_size=out.timing["batch_size"])
    return await _guard(request, work(), "videos_sync")


async def _dynamics_sync(request: Request, service: Service, req: DynamicsRequest) -> Response:
    """FD: the MP4 itself (vLLM-Omni's sync answer), or JSON with `b64_json` under `Accept: application/json`;
    ID: the JSON form with `action`."""
    out = await until_disconnect(request, service.run_dynamics(req, surface="videos_sync", received=time.monotonic(),
                                                               request_id=new_request_id("video_sync")))
    rec: dict[str, Any] = {"id": out.request_id}
    mp4 = await dynamics_record(rec, out, req)
    headers = {"X-Request-Id": rec["id"], "X-Model": service.config.model_name,
               "X-Inference-Time-S": f"{rec['inference_time_s']:.6f}",
               "X-Stage-Durations": json.dumps(out.stage_durations),
               "X-Peak-Memory-MB": f"{rec['peak_memory_mb']:.1f}"}
    if mp4 is not None and "application/json" not in (request.headers.get("accept") or ""):
        return Response(mp4, media_type="video/mp4", headers=headers)
    import base64

    body = {"created": int(time.time()), "id": out.request_id,
            "data": [{"b64_json": base64.b64encode(mp4).decode() if mp4 is not None else None, "url": None,
                      "revised_prompt": None, "action": rec["action"]}],
            "stage_durations": out.stage_durations, "peak_memory_mb": rec["peak_memory_mb"],
            "inference_time_s": rec["inference_time_s"], "timing": out.timing, "metadata": rec["metadata"],
            "video": rec.get("video")}
    return JSONResponse(body, headers=headers)


async def _generation_sync(request: Request, service: Service, req: GenerationRequest) -> Response:
    """The MP4 itself (vLLM-Omni's sync answer), or JSON with it in `data[0].b64_json` under
    `Accept: application/json`. A client that hangs up cancels the job at its next denoising step."""
    out = await until_disconnect(request, service.generate(req, surface="videos_sync",
                                                           request_id=new_request_id("video_sync")))
    rec: dict[str, Any] = {"id": out.request_id}
    generation_record(rec, out, req)
    headers = _headers(service, rec["id"], rec, out.stage_durations, out.timing)
    assert out.mp4 is not None
    if "application/json" not in (request.headers.get("accept") or ""):
        return Response(out.mp4, media_type="video/mp4", headers=headers)
    import base64

    body = {"created": int(time.time()), "id": out.request_id,
            "data": [{"b64_json": base64.b64encode(out.mp4).decode(), "url": None, "revised_prompt": None,
                      "action": None}],
            "stage_durations": out.stage_durations, "peak_memory_mb": rec["peak_memory_mb"],
            "inference_time_s": rec["inference_time_s"], "timing": out.timing, "metadata": rec["metadata"],
            "video": rec["video"]}
    return JSONResponse(body, headers=headers)


async def get_video(request: Request) -> Response:
    rec = jobs_of(request).records.get(request.path_params["video_id"])
    if rec is None:
        err = NotFound("no such video job")
        return JSONResponse(err.body(), status_code=404)
    return JSONResponse(rec)


async def list_videos(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": list(jobs_of(request).records.values())})


async def delete_video(request: Request) -> Response:
    """An unfinished job is cancelled and its record kept as `cancelled` (a second DELETE removes it); a
    finished one is removed with its content."""
    jobs = jobs_of(request)
    vid = request.path_params["video_id"]
    rec = jobs.records.get(vid)
    if rec is None:
        return JSONResponse(NotFound("no such video job").body(), status_code=404)
    if rec["status"] in UNFINISHED:
        jobs.cancel(vid)
        return JSONResponse({"id": vid, "object": "video.deleted", "deleted": True, "status": "cancelled"})
    jobs.remove(vid)
    return JSONResponse({"id": vid, "object": "video.deleted", "deleted": True})


async def video_content(request: Request) -> Response:
    jobs, vid = jobs_of(request), request.path_params["video_id"]
    rec = jobs.records.get(vid)
    if rec is None:
        return JSONResponse(NotFound("no such video job").body(), status_code=404)
    if vid in jobs.content:  # forward dynamics / generation: the MP4
        return Response(jobs.content[vid], media_type="video/mp4")
    if vid in jobs.makes_video:  # not there (yet): say why
        err = Conflict(f"the job is {rec['status']}; its video exists only once it is completed")
        return JSONResponse(err.body(), status_code=err.status)
    # Policy / inverse dynamics are action-only (empty, as vLLM-Omni's).
    return Response(b"", media_type="video/mp4")


async def list_models(request: Request) -> Response:
    name = service_of(request).config.model_name
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "wamrt"}]})
