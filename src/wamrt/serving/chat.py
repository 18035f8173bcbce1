"""OpenAI-compatible `POST /v1/chat/completions` on the served checkpoint's Reasoner.

Request: `model`, `messages` (roles system / developer / user / assistant; content a string or parts `text`,
`image_url` and vLLM's `video_url`, both as data: URLs), `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `stop`, `seed`, `stream` (+ `stream_options.include_usage`), and vLLM's `top_k`, `repetition_penalty`,
`ignore_eos`. Features this runtime does not have (tools, logprobs, n > 1, presence / frequency penalties, JSON
response formats) are refused naming the field, never silently dropped. Errors come in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with the serving error's HTTP status.

Bounds, checked before the work they bound: the body (`--max-frame-mb`), an image's decoded pixels and a video's
decoded pixels over all its frames (`--chat-max-image-pixels`, read from the headers before decoding), prompt tokens
(`--chat-max-prompt-tokens`, media tokens counted from the resized sizes before the text is tokenized) and
`max_tokens` (`--chat-max-tokens`). Decoding runs on the Reasoner thread (`chat_worker.ChatWorker`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..pipeline.errors import RequestError
from .body import read_body
from .chat_worker import ChatJob, ChatUpdate
from .errors import Cancelled, InvalidRequest, NotFound, ServingError
from .fields import as_float, as_int
from .http_api import service_of, until_disconnect
from .limits import loads_json
from .logs import log_request

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "audio", "modalities", "prediction", "web_search_options")


def openai_error(err: ServingError, request_id: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    body = {"error": {"message": err.message, "type": kind, "param": err.field, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers={"X-Request-Id": request_id} if request_id else None)


def _data_url(url: Any, field: str) -> bytes:
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise InvalidRequest("only data: URLs are accepted (data:image/png;base64,...)", field=field)
    try:
        return base64.b64decode(url.split(",", 1)[1], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"bad base64 ({exc})", field=field) from exc


def _image(raw: bytes, field: str, max_pixels: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(raw))
        w, h = im.size  # from the header: nothing decoded yet
        if w * h > max_pixels:
            raise InvalidRequest(f"{w}x{h} = {w * h} pixels is over this server's {max_pixels} "
                                 "(--chat-max-image-pixels)", field=field)
        return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"not a readable image ({exc})", field=field) from exc


def _video(raw: bytes, field: str, max_pixels: int) -> tuple[Any, float]:
    """A data-URL video -> (uint8 [T, H, W, 3], fps); at most `max_pixels` decoded over all frames."""
    from .media import require_pyav

    require_pyav(field)
    import av
    import numpy as np

    frames = []
    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.video:
                raise InvalidRequest("holds no video stream", field=field)
            stream = container.streams.video[0]
            fps = float(stream.average_rate or 0) or 24.0
            per_frame = stream.codec_context.width * stream.codec_context.height
            for frame in container.decode(stream):
                if per_frame * (len(frames) + 1) > max_pixels:
                    raise InvalidRequest(f"more than {max_pixels} decoded pixels over its frames "
                                         "(--chat-max-image-pixels)", field=field)
                frames.append(frame.to_ndarray(format="rgb24"))
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001  # av.error.*: not a readable video
        raise InvalidRequest(f"not a readable video ({type(exc).__name__})", field=field) from exc
    if not frames:
        raise InvalidRequest("holds no frames", field=field)
    return np.stack(frames), fps


def reasoner_messages(messages: Any, max_pixels: int) -> list[dict[str, Any]]:
    """OpenAI messages -> the Reasoner's (`reasoner.prompt`): data URLs decoded, roles mapped, bad parts named."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("must be a non-empty list of messages", field="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(f"role must be one of {', '.join(ROLES)}", field=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": ROLES[m["role"]], "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequest("must be a string or a list of content parts", field=f"{where}.content")
        parts = []
        for j, p in enumerate(content):
            field = f"{where}.content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif kind == "image_url":
                parts.append({"type": "image", "image": _image(_data_url(p.get("image_url"), field), field,
                                                               max_pixels)})
            elif kind == "video_url":
                frames, fps = _video(_data_url(p.get("video_url"), field), field, max_pixels)
                parts.append({"type": "video", "video": frames, "fps": fps})
            else:
                raise InvalidRequest("must be a text, image_url or video_url part", field=field)
        out.append({"role": ROLES[m["role"]], "content": parts})
    return out


def sampling_params(fields: dict[str, Any], max_tokens_cap: int) -> Any:
    from ..reasoner.sampling import SamplingParams

    for name in UNSUPPORTED:
        if fields.get(name) not in (None, False, [], {}):
            raise InvalidRequest("is not supported by this runtime", field=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if fields.get(name) not in (None, 0, 0.0):
            raise InvalidRequest("is not supported by this runtime (use repetition_penalty)", field=name)
    if fields.get("n") not in (None, 1):
        raise InvalidRequest("only n = 1 is served", field="n")
    fmt = fields.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise InvalidRequest("only {\"type\": \"text\"} is served", field="response_format")
    name = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = max_tokens_cap
    if fields.get(name) is not None:
        max_tokens = as_int(fields[name], name, 1, max_tokens_cap)
    stop = fields.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("must be a string or a list of strings", field="stop")
    kw: dict[str, Any] = {"max_tokens": max_tokens, "stop": tuple(stop or ())}
    for key in ("temperature", "top_p", "repetition_penalty"):
        if fields.get(key) is not None:
            kw[key] = as_float(fields[key], key)
    if kw.get("temperature", 1.0) > 2:
        raise InvalidRequest(f"must be in [0, 2], got {kw['temperature']}", field="temperature")
    if fields.get("top_k") is not None:
        kw["top_k"] = max(0, as_int(fields["top_k"], "top_k", -1, 1 << 20))  # vLLM: -1 = off
    if fields.get("seed") is not None:
        kw["seed"] = as_int(fields["seed"], "seed", -(2**63), 2**63 - 1)
    if fields.get("ignore_eos") is not None:
        if not isinstance(fields["ignore_eos"], bool):
            raise InvalidRequest("must be a boolean", field="ignore_eos")
        kw["ignore_eos"] = fields["ignore_eos"]
    try:
        return SamplingParams(**kw)
    except RequestError as exc:
        raise InvalidRequest(str(exc).split(": ", 1)[-1], field=exc.field) from exc


def parse_chat(fields: Any, service: Any) -> tuple[Any, Any, bool, bool]:
    """-> (prepared prompt, sampling params, stream, include_usage). CPU work (image decode, tokenizing): off the
    event loop."""
    cfg = service.config
    if not isinstance(fields, dict):
        raise InvalidRequest("request must be a JSON object")
    model = fields.get("model")
    if model not in (None, "", cfg.model_name):
        raise NotFound(f"model {model!r} is not served here (this server serves {cfg.model_name!r}; GET /v1/models)",
                       field="model")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("must be a boolean", field="stream")
    options = fields.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("must be an object", field="stream_options")
    params = sampling_params(fields, cfg.chat_max_tokens)
    messages = reasoner_messages(fields.get("messages"), cfg.chat_max_image_pixels)
    try:
        prompt = service.reasoner.prepare(messages, max_prompt_tokens=cfg.chat_max_prompt_tokens)
    except RequestError as exc:
        raise InvalidRequest(str(exc).split(": ", 1)[-1] if exc.field else str(exc), field=exc.field) from exc
    return prompt, params, stream, bool(options.get("include_usage"))


def _chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None) -> str:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


async def chat_completions(request: Request) -> Response:
    service, received = service_of(request), time.monotonic()
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    loop = asyncio.get_running_loop()

    def failed(exc: BaseException) -> ServingError:  # counted and logged; rows of one batch: no batch size
        err = service.count_error(exc)
        log_request(service, "chat", rid, received, error=err)
        return err

    updates: asyncio.Queue[ChatUpdate] = asyncio.Queue()
    try:
        if service.chat is None:
            raise InvalidRequest(f"the served checkpoint has no Reasoner chat: {service.reasoner_note}", field="model")
        service.accepting()
        body = await read_body(request, service.limits)
        fields = await service.offload(loads_json, body, limits=service.limits)
        prompt, params, stream, include_usage = await service.offload(parse_chat, fields, service)
        job = ChatJob(prompt, params, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u), rid)
        service.chat.submit(job)
    except Exception as exc:  # noqa: BLE001  # typed, in OpenAI's shape
        return openai_error(failed(exc), rid)
    created, model = int(time.time()), service.config.model_name
    usage = lambda n: {"prompt_tokens": prompt.length, "completion_tokens": n,  # noqa: E731
                       "total_tokens": prompt.length + n}

    if stream:
        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                yield _chunk(rid, created, model, {"role": "assistant", "content": ""})
                while True:
                    u = await updates.get()
                    if u.error is not None:
                        err = failed(u.error)
                        yield f"data: {json.dumps(json.loads(openai_error(err).body))}\n\n"
                        break
                    if u.text:
                        yield _chunk(rid, created, model, {"content": u.text})
                    if u.finish_reason is not None:
                        yield _chunk(rid, created, model, {}, u.finish_reason)
                        if include_usage:
                            body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": [], "usage": usage(u.tokens)}
                            yield f"data: {json.dumps(body)}\n\n"
                        break
                finished = True
                if u.error is None:
                    log_request(service, "chat", rid, received)
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client left mid-stream: its row is freed at the next step
                    service.chat.cancel(job)
                    log_request(service, "chat", rid, received, error=Cancelled("client left mid-stream"))

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})

    async def collect() -> ChatUpdate:
        parts = []
        while True:
            u = await updates.get()
            parts.append(u.text)
            if u.done:
                u.text = "".join(parts)
                return u

    try:
        final = await until_disconnect(request, collect())
    except Exception as exc:  # noqa: BLE001  # the client left (Cancelled): its row is freed at the next step
        service.chat.cancel(job)
        return openai_error(failed(exc), rid)
    if final.error is not None:
        return openai_error(failed(final.error), rid)
    log_request(service, "chat", rid, received)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": final.text},
                         "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": usage(final.tokens)}
    return JSONResponse(body, headers={"X-Request-Id": rid})
