"""`wamrt serve`: its flags (parsed in `wamrt.cli.serve`) -> `ServeConfig`, the uvicorn launch, and `ServerThread` (a
loopback server for tests and bench)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, Self

import uvicorn

from ..cli.serve import add_arguments  # noqa: F401  (the flags live with the other parsers)
from ..net import free_port
from .app import build_app
from .batcher import BatchPolicy
from .config import ServeConfig, ServeConfigError
from .connections import DrainingServer, guarded_h11
from .logs import configure_logging


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        host=args.host, port=args.port, api_key=args.api_key, max_batch=args.max_batch or ServeConfig.max_batch,
        max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, max_frame_bytes=int(args.max_frame_mb * 2**20),
        steps=args.steps, guidance=args.guidance, shift=args.shift,
        guidance_interval=tuple(args.guidance_interval) if args.guidance_interval else None,
        safety_file=args.safety, warmup_requests=args.warmup, model_name=str(args.model),
        prompt_bucket=args.prompt_bucket, prompt_width=args.prompt_width, batch_invariant=args.batch_invariant,
        max_video_pixels=args.max_video_pixels or ServeConfig.max_video_pixels,
        max_generation_jobs=args.max_generation_jobs, sampler=args.sampler,
        generation_step_segments=args.generation_step_segments, generation_warmup=tuple(args.generation_warmup),
        attention=args.attention, epilogues=args.epilogues, chat_max_batch=args.chat_max_batch,
        chat_decode=args.chat_decode,
        chat_max_queue=args.chat_max_queue, chat_context=args.chat_context,
        chat_max_prompt_tokens=args.chat_max_prompt_tokens, chat_max_tokens=args.chat_max_tokens,
        chat_max_image_pixels=args.chat_max_image_pixels, upsample_max_tokens=args.upsample_max_tokens,
        added_latency_ms=args.added_latency_ms, gpu_memory_gib=args.gpu_memory,
        capture_on_request=args.capture_on_request, **{name: getattr(args, name) for name in LIMIT_FIELDS},
    )


# ServeConfig fields of the request and connection bounds (limits.py, connections.py), flags in cli/serve.py.
LIMIT_FIELDS = ("max_prompt_tokens", "max_generation_prompt_tokens", "max_policy_steps", "max_image_pixels",
                "max_step_ms", "max_job_s", "body_timeout_s", "header_timeout_s", "keep_alive_s", "ws_ping_s",
                "ws_idle_s", "max_connections", "shutdown_grace_s", "ready_stall_s")


def uvicorn_config(app: Any, config: ServeConfig, *, log_level: str = "info",
                   log_format: str = "text") -> uvicorn.Config:
    # ws_max_size bounds inbound frames (over it: close 1009); h11 (with a head deadline and a connection cap,
    # connections.py) rather than httptools: one parser everywhere, and the dependency set stays small. JSON logs:
    # uvicorn leaves its loggers to the root handler (logs.configure_logging) instead of its own text handlers.
    own_logging = {"log_config": None} if log_format == "json" else {}
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, ws="websockets-sansio",
                          http=guarded_h11(config.header_timeout_s, config.max_connections),
                          ws_max_size=config.max_frame_bytes, ws_ping_interval=config.ws_ping_s,
                          ws_ping_timeout=config.ws_ping_s, timeout_keep_alive=config.keep_alive_s,
                          h11_max_incomplete_event_size=16 * 1024, lifespan="on",
                          timeout_graceful_shutdown=config.shutdown_grace_s, **own_logging)


def server_for(app: Any, config: ServeConfig, *, log_level: str = "info", log_format: str = "text") -> uvicorn.Server:
    """The uvicorn server of `app` (from `build_app`), draining its service on SIGTERM."""
    return DrainingServer(uvicorn_config(app, config, log_level=log_level, log_format=log_format),
                          app.state.service, config.shutdown_grace_s)


def warn_if_open(config: ServeConfig) -> None:
    """A server reachable from other hosts without a key serves anyone who finds it: say so at startup."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(config.host).is_loopback
    except ValueError:
        loopback = config.host == "localhost"
    if config.api_key is None and not loopback:
        print(f"wamrt serve: WARNING: listening on {config.host} without --api-key: anyone who can reach this port "
              "can drive the policy", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from .startup import StartupError, load

    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ServeConfigError as exc:
        print(f"wamrt serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "ray", False):
        from . import ray_serve  # needs ray[serve]

        return ray_serve.run(args, config)
    if args.parallel != "none":
        return _run_parallel(args, config)
    if getattr(args, "plan_only", False):
        from .startup import print_plan

        return print_plan(args, config)
    warn_if_open(config)
    try:  # the port, the checkpoint folder and the memory plan before the weights (startup.py)
        policy, sock, info = load(args, config)
    except StartupError as exc:
        print(f"wamrt serve: {exc}", file=sys.stderr)
        return 2
    app = build_app(policy, config)
    service = app.state.service
    service.startup_info = info  # the summary line at ready
    server = server_for(app, config, log_level=args.log_level, log_format=args.log_format)
    service.on_warmup_failure = lambda: setattr(server, "should_exit", True)  # drain, then exit
    with sock:
        server.run(sockets=[sock])
    if service.warmup_error:
        print(f"wamrt serve: warm-up failed: {service.warmup_error}", file=sys.stderr)
        return 1
    return 0


def _run_parallel(args: argparse.Namespace, config: ServeConfig) -> int:
    """Rank 0 of a multi-GPU engine serves; the other ranks are worker processes it starts."""
    from ..parallel import ParallelSpec, start

    device = args.device or "cuda"
    try:
        # ranks decide in lockstep: a missing graph is captured on the request path by all of them
        settings = {**config.engine_settings(device), "capture_on_request": True}
    except ServeConfigError as exc:
        print(f"wamrt serve: {exc}", file=sys.stderr)
        return 2
    try:
        # World layouts split every step of a generation job into segments only on CUDA, as one GPU does.
        policy = start(ParallelSpec(args.parallel, str(args.model), world=args.gpus, device=device, engine=settings,
                                    tokenizer="variable", tokenizer_dir=args.tokenizer, vae_dir=args.vae,
                                    step_segments=config.generation_step_segments if device.startswith("cuda") else 1))
    except ValueError as exc:  # a layout the GPUs or heads do not divide, GPUs missing
        print(f"wamrt serve: --parallel {args.parallel}: {exc}", file=sys.stderr)
        return 2
    try:
        server_for(build_app(policy, config), config, log_level=args.log_level, log_format=args.log_format).run()
    finally:
        policy.close()
    return 0


class ServerThread:
    """A real uvicorn server on 127.0.0.1:<ephemeral> in a thread; `with ServerThread(policy) as s:`."""

    def __init__(self, policy: BatchPolicy, config: ServeConfig | None = None, *, wait_ready: bool = True,
                 log_level: str = "warning") -> None:
        self.config = config or ServeConfig()
        self.config.host = "127.0.0.1"
        self.config.port = self.config.port if self.config.port not in (0, 8000) else free_port()
        self.app = build_app(policy, self.config)
        self.server = server_for(self.app, self.config, log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, name="wamrt-uvicorn", daemon=True)
        self.wait_ready = wait_ready

    @property
    def service(self) -> Any:
        return self.app.state.service

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.config.port}"

    def start(self, timeout: float = 120.0) -> Self:
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        while self.wait_ready and not self.service.ready:
            if self.service.warmup_error or time.monotonic() > end:
                error = self.service.warmup_error or f"not ready after {timeout:g} s"
                self.stop()  # a server that will not be used does not keep its port and threads
                raise RuntimeError(f"warm-up failed: {error}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
