"""The ASGI app: every surface over one `Service` (one batcher, one engine thread)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from . import chat, http_api, images, videos
from .auth import ApiKeyMiddleware
from .batcher import BatchPolicy
from .config import ServeConfig
from .openapi import openapi_spec
from .openpi_ws import VLLM_PATH, openpi_socket
from .service import Service
from .video_jobs import VideoJobs


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec())


def build_app(policy: BatchPolicy, config: ServeConfig | None = None) -> ApiKeyMiddleware:
    """Starlette app wrapped in the API-key check. Lifespan starts the engine thread and warms up."""
    config = config or ServeConfig()
    service = Service(policy, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start()
        warm = asyncio.ensure_future(service.warm_up())  # listen meanwhile: /healthz up, /readyz 503
        try:
            yield
        finally:
            warm.cancel()
            app.state.video_jobs.cancel_all()
            # After the drain (connections.DrainingServer) the threads are idle; a stuck one is a daemon and is
            # not waited for past the grace.
            await asyncio.get_running_loop().run_in_executor(None, service.stop, config.shutdown_grace_s / 2)

    routes = [
        WebSocketRoute("/", openpi_socket),
        WebSocketRoute(VLLM_PATH, openpi_socket),
        Route("/v1/policy/infer", http_api.policy_infer, methods=["POST"]),
        Route("/v1/policy/metadata", http_api.policy_metadata, methods=["GET"]),
        Route("/v1/metadata", http_api.policy_metadata, methods=["GET"]),
        Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
        Route("/healthz", http_api.healthz, methods=["GET"]),
        Route("/health", http_api.healthz, methods=["GET"]),
        Route("/readyz", http_api.readyz, methods=["GET"]),
        Route("/metrics", http_api.metrics, methods=["GET"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        Route("/v1/models", videos.list_models, methods=["GET"]),
        Route("/v1/videos", videos.create_video, methods=["POST"]),
        Route("/v1/videos", videos.list_videos, methods=["GET"]),
        Route("/v1/videos/sync", videos.create_video_sync, methods=["POST"]),
        Route("/v1/videos/{video_id}", videos.get_video, methods=["GET"]),
        Route("/v1/videos/{video_id}", videos.delete_video, methods=["DELETE"]),
        Route("/v1/videos/{video_id}/content", videos.video_content, methods=["GET"]),
        Route("/v1/images/generations", images.create_image, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    app.state.video_jobs = VideoJobs(service)
    outer = ApiKeyMiddleware(app, config.api_key, on_reject=service.count_error)
    outer.state = app.state  # type: ignore[attr-defined]  # tests reach the service through the wrapper
    return outer
