"""`wamrt serve` flags, the uvicorn launch, and `ServerThread` (a loopback server for tests and bench)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Any, Self

import uvicorn

from ..net import free_port
from .app import build_app
from .batcher import BatchPolicy
from .config import ATTENTION_CHOICES, EPILOGUE_CHOICES, ServeConfig, ServeConfigError
from .generation_settings import SAMPLER_CHOICES


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-droid",
                    help="checkpoint folder or built-in name (default: the embedded tiny-droid)")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' or 'Api-Key' (probes stay open)")
    ap.add_argument("--max-batch", type=int, default=8, help="requests per infer_batch call")
    ap.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for companions")
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before 'busy' (HTTP 429)")
    ap.add_argument("--max-frame-mb", type=float, default=64.0, help="largest websocket frame / HTTP body")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default: the policy's, 4)")
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument("--shift", type=float, default=None)
    ap.add_argument("--guidance-interval", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    ap.add_argument("--max-video-pixels", type=int, default=ServeConfig.max_video_pixels, metavar="N",
                    help="world generation: largest width x height x frames (x images) of one job "
                         f"(default {ServeConfig.max_video_pixels} = 1280x720 x 189 frames); larger ones get 400")
    ap.add_argument("--max-generation-jobs", type=int, default=ServeConfig.max_generation_jobs, metavar="N",
                    help="world-generation jobs queued or running at once (their own queue; over it: busy, 429)")
    ap.add_argument("--generation-step-segments", type=int, default=ServeConfig.generation_step_segments,
                    metavar="N",
                    help="CUDA servers: split every denoising step of a generation job into N graphs of consecutive "
                         "layers (at most one per layer), so a policy request waits for 1/N of a step, not a whole "
                         f"step (default {ServeConfig.generation_step_segments}); see docs/serving.md")
    ap.add_argument("--generation-warmup", action="append", default=[], metavar="FIELDS",
                    help="a world-generation job run before /readyz turns 200, so that a GPU server compiles and "
                         "captures its shape before robots connect: a JSON object of /v1/videos/sync fields, e.g. "
                         "'{\"size\": \"832x480\", \"num_frames\": \"33\", \"input_reference\": \"@sample\"}' "
                         "(@sample = a built-in picture, @PATH = a file; prompt optional); repeat for more shapes")
    ap.add_argument("--sampler", choices=SAMPLER_CHOICES, default="auto",
                    help="world generation's sampler: auto = the checkpoint's (the distilled few-step sampler when "
                         "the checkpoint folder declares a distilled schedule, else UniPC with CFG); unipc; distilled "
                         "(refused at startup on a checkpoint without a distilled schedule); see docs/serving.md")
    ap.add_argument("--safety", default=None, metavar="FILE", help="action safety envelope (JSON or TOML)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before /readyz says ready")
    ap.add_argument("--engine", choices=["auto", "eager", "fast"], default="auto",
                    help="fast = the batching engine (fused, compiled, CUDA graphs on a GPU); eager = reference path; "
                         "auto = fast on CUDA, eager on CPU")
    ap.add_argument("--prompt-bucket", type=int, default=ServeConfig.prompt_bucket, metavar="TOKENS",
                    help="fast engine: pad instruction prefixes to a multiple of TOKENS (zero keys, removed exactly) "
                         "so one CUDA graph serves every instruction length in the bucket and any mix of them in a "
                         f"batch (default {ServeConfig.prompt_bucket}); 0 = exact lengths (a capture per new length "
                         "combination); see docs/serving.md")
    ap.add_argument("--prompt-width", type=int, default=0, metavar="TOKENS",
                    help="with --prompt-bucket: pad every batch's instruction prefixes to at least TOKENS (a multiple "
                         "of the bucket), so warm-up captures the graphs every instruction up to TOKENS replays and "
                         "no mix of lanes captures later; a longer one widens its batch (a new capture); "
                         "0 = each batch's own bucket; see docs/serving.md")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="fast engine: compute every request alone at its own fixed shape (VAE encode and "
                         "denoising loop at batch 1; host work still batched), so its actions do not depend on "
                         "which requests share its batch or where it sits in it, and a rollout replays bit for "
                         "bit (paired gates); GPU work is no longer shared across requests")
    ap.add_argument("--attention", choices=ATTENTION_CHOICES, default=ServeConfig.attention,
                    help="fast engine on CUDA: the Generator attention kernel; fa4 = flash-attn-4 (optional install; "
                         "the fastest measured on the H200, see README)")
    ap.add_argument("--epilogues", choices=EPILOGUE_CHOICES, default=ServeConfig.epilogues,
                    help="fast engine on CUDA: quack = the MLP activation inside the up-projection GEMM's epilogue "
                         "(quack-kernels, which flash-attn-4 brings; Nano -14 ms per request on the H200); "
                         "inductor = cuBLAS GEMMs and compiled elementwise kernels")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of this host behind one engine (with --parallel)")
    ap.add_argument("--parallel", choices=["none", "cfg", "tp"], default="none",
                    help="cfg = one CFG branch per GPU (2 GPUs, full model each); tp = every layer split across "
                         "--gpus GPUs (models too large for one GPU); see docs/deployment.md")
    ap.add_argument("--ray", action="store_true",
                    help="serve on Ray Serve: --replicas engine replicas (each owning --gpus GPUs) behind one endpoint")
    ap.add_argument("--replicas", type=int, default=1, help="Ray replicas (with --ray)")
    ap.add_argument("--max-replicas", type=int, default=None,
                    help="with --ray: autoscale between --replicas and this on ongoing requests per replica")
    ap.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        host=args.host, port=args.port, api_key=args.api_key, max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, max_frame_bytes=int(args.max_frame_mb * 2**20),
        steps=args.steps, guidance=args.guidance, shift=args.shift,
        guidance_interval=tuple(args.guidance_interval) if args.guidance_interval else None,
        safety_file=args.safety, warmup_requests=args.warmup, model_name=str(args.model),
        prompt_bucket=args.prompt_bucket, prompt_width=args.prompt_width, batch_invariant=args.batch_invariant,
        max_video_pixels=args.max_video_pixels, max_generation_jobs=args.max_generation_jobs, sampler=args.sampler,
        generation_step_segments=args.generation_step_segments, generation_warmup=tuple(args.generation_warmup),
        attention=args.attention, epilogues=args.epilogues,
    )


def uvicorn_config(app: Any, config: ServeConfig, *, log_level: str = "info") -> uvicorn.Config:
    # ws_max_size bounds inbound frames (over it: close 1009); h11 keeps the dependency set small.
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, ws="websockets-sansio",
                          ws_max_size=config.max_frame_bytes, ws_ping_interval=None, lifespan="on",
                          timeout_graceful_shutdown=5)


def run(args: argparse.Namespace) -> int:
    from ..pipeline.policy import load_policy

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
    policy = load_policy(args.model, device=args.device)
    if args.engine == "fast" or (args.engine == "auto" and policy.device.type == "cuda"):
        from ..engine import Engine, EngineConfig

        try:
            settings = config.engine_settings(str(policy.device))
        except ServeConfigError as exc:
            print(f"wamrt serve: {exc}", file=sys.stderr)
            return 2
        # same infer_batch/metadata contract, batched on the GPU
        policy = Engine.from_policy(policy, EngineConfig(**settings))
    elif (config.attention, config.epilogues) != (ServeConfig.attention, ServeConfig.epilogues):
        flag = "--attention" if config.attention != ServeConfig.attention else "--epilogues"
        print(f"wamrt serve: {flag}: applies to the fast engine (--engine fast, or auto on CUDA); this server runs "
              f"the eager reference on {policy.device}", file=sys.stderr)
        return 2
    uvicorn.Server(uvicorn_config(build_app(policy, config), config, log_level=args.log_level)).run()
    return 0


def _run_parallel(args: argparse.Namespace, config: ServeConfig) -> int:
    """Rank 0 of a multi-GPU engine serves; the other ranks are worker processes it starts."""
    from ..parallel import ParallelSpec, start

    device = args.device or "cuda"
    policy = start(ParallelSpec(args.parallel, str(args.model), world=args.gpus, device=device,
                                engine=config.engine_settings(device), tokenizer="variable"))
    try:
        uvicorn.Server(uvicorn_config(build_app(policy, config), config, log_level=args.log_level)).run()
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
        self.server = uvicorn.Server(uvicorn_config(self.app, self.config, log_level=log_level))
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
