"""vLLM-Omni / OpenAI-compatible `POST /v1/images/generations`: text -> image on the served checkpoint.

JSON (or form) fields: `prompt` (required), `model`, `n` (1-10), `size` "WxH" (default 1024x1024),
`response_format` ("b64_json", the only one served), `user` (ignored), and vLLM-Omni's extensions
`negative_prompt`, `num_inference_steps` (50), `guidance_scale` (7.0), `flow_shift` (10), `seed` (on a
distilled checkpoint: its own step count, guidance 1 and shift, see `generation.build_generation`). The reply
is `{created, data: [{b64_json: <PNG>, url: null, revised_prompt: null}], ...}`; image k of `n` uses seed
`seed + k`. It runs as a generation job (`generation.py`): own queue, the device only between policy
batches; a client that hangs up cancels it.
"""

from __future__ import annotations

import base64
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .generation_request import build_generation
from .http_api import service_of, until_disconnect
from .logs import logged_reply
from .service import new_request_id
from .video_jobs import _peak_memory_mb
from .videos import _guard, _headers, _read_fields


async def create_image(request: Request) -> Response:
    async def work() -> Response:
        service, received = service_of(request), time.monotonic()
        cfg = service.config
        fields = await _read_fields(request, service)
        req = await service.offload(build_generation, fields, service.world, kind="image",
                                    max_pixels=cfg.max_video_pixels, model_name=cfg.model_name,
                                    limits=service.limits, cost=service.cost)
        out = await until_disconnect(request, service.generate(req, surface="images",
                                                               request_id=new_request_id("image")))
        rec = {"inference_time_s": out.timing["total_ms"] / 1e3, "peak_memory_mb": _peak_memory_mb()}
        body = {"created": int(time.time()), "id": out.request_id,
                "data": [{"b64_json": base64.b64encode(png).decode(), "url": None,
                          "revised_prompt": out.upsampled["prompt"] if out.upsampled else None} for png in out.pngs],
                "stage_durations": out.stage_durations, **rec, "timing": out.timing,
                "metadata": {"seed": out.seed, **req.sampling, "size": req.record["size"],
                             **({"notes": out.notes} if out.notes else {}),
                             **({"upsampled_prompt": out.upsampled} if out.upsampled else {})}}
        return logged_reply(service, "images", received,
                            JSONResponse(body, headers=_headers(service, out.request_id, rec,
                                                                out.stage_durations)))

    return await _guard(request, work(), "images")
