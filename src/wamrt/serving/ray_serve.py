"""Ray Serve: N engine replicas behind one endpoint, with the same HTTP and websocket surfaces.

Each replica is a Ray actor that owns its GPU(s) (`ray_actor_options.num_gpus`) and runs the whole
`wamrt serve` ASGI app (`build_app`: openpi websocket, /v1/policy/infer, /v1/videos, probes, metrics)
over its own engine and batcher; the app is handed to Ray's ingress late-bound
(`__serve_build_asgi_app__`, any ASGI app), so there is no FastAPI layer and no router of our own: Ray's
proxy routes every HTTP request and every websocket connection to a replica. A websocket is one ASGI
call, so a robot's session stays on the replica that accepted it for its whole lifetime; if that
replica dies the connection closes (the client sees a closed socket) and a reconnect lands on a live
replica. Autoscaling is Ray's, on ongoing requests per replica (an open websocket session counts as
one), see `deploy/ray_serve.yaml` and docs/deployment.md.

    wamrt serve --ray --replicas 2 --model random:nano          # local Ray cluster, 2 GPUs, 1 each
    serve run deploy/ray_serve.yaml                              # the documented config file
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from typing import Any

from ray import serve

from .app import build_app
from .config import ServeConfig

log = logging.getLogger("wamrt.serving")


@serve.ingress()  # late-bound: __serve_build_asgi_app__ returns the replica's own app
class PolicyReplica:
    """One engine: `model` on this replica's GPU(s) (`parallel` cfg/tp over `gpus`), or the CPU; `tokenizer` / `vae`
    replace the checkpoint's own folders (`--tokenizer` / `--vae`; paths every replica's host can read)."""

    def __init__(self, model: str = "tiny-droid", device: str | None = None, gpus: int = 1, parallel: str = "none",
                 serve_config: dict[str, Any] | None = None, tokenizer: str | None = None,
                 vae: str | None = None) -> None:
        import ray
        import torch

        self.config = ServeConfig(**(serve_config or {}))
        self.replica = ray.get_runtime_context().get_actor_name() or f"pid-{os.getpid()}"
        self.config.extra_metadata = {**self.config.extra_metadata, "replica": self.replica}
        self.config.model_name = self.config.model_name or model
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if parallel != "none":
            from ..parallel import ParallelSpec, start

            engine = {**self.config.engine_settings(device), "capture_on_request": True}  # ranks in lockstep
            self.policy: Any = start(ParallelSpec(parallel, model, world=gpus, device=device, engine=engine,
                                                  tokenizer="variable", tokenizer_dir=tokenizer, vae_dir=vae))
        else:
            from ..pipeline.policy import load_policy

            self.policy = load_policy(model, device=device, tokenizer=tokenizer, vae=vae)
            if self.policy.device.type == "cuda":
                from ..engine import Engine, EngineConfig

                self.policy = Engine.from_policy(self.policy, EngineConfig(**self.config.engine_settings(device)))
        log.info("replica %s: %s on %s", self.replica, model, device)

    def __serve_build_asgi_app__(self):
        return build_app(self.policy, self.config)


def deployment_options(*, replicas: int = 1, max_replicas: int | None = None, gpus_per_replica: float = 1.0,
                       cpus_per_replica: float = 1.0, max_batch: int = 8) -> dict[str, Any]:
    """Ray options: replicas own their GPUs; autoscale between `replicas` and `max_replicas` on queue depth
    (ongoing requests per replica: queued + running requests and open websocket sessions)."""
    top = max(max_replicas or replicas, replicas)
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica},
        "max_ongoing_requests": 4 * max_batch,  # beyond this the proxy queues (or picks another replica)
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": 10,
    }
    if top > replicas:
        opts["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas, "max_replicas": top,
                                      "target_ongoing_requests": max_batch, "upscale_delay_s": 5,
                                      "downscale_delay_s": 120}
    else:
        opts["num_replicas"] = replicas
    return opts


def application(model: str, *, device: str | None = None, gpus: int = 1, parallel: str = "none",
                serve_config: ServeConfig | None = None, tokenizer: str | None = None, vae: str | None = None,
                **options: Any):
    """A bound Serve application (for `serve.run`)."""
    cfg = dataclasses.asdict(serve_config or ServeConfig(model_name=model))
    dep = serve.deployment(PolicyReplica, name="PolicyReplica", **options)
    return dep.bind(model, device, gpus, parallel, cfg, tokenizer, vae)


def build(args: dict[str, Any]):
    """Application builder for a Serve config file (`import_path: wamrt.serving.ray_serve:build`).
    `args`: model, device, gpus, parallel, tokenizer, vae and any ServeConfig field (max_batch, steps, api_key, ...).
    Replica counts, autoscaling and resources come from the file's `deployments:` section."""
    args = dict(args)
    model = str(args.pop("model", "tiny-droid"))
    device, gpus, parallel = args.pop("device", None), int(args.pop("gpus", 1)), str(args.pop("parallel", "none"))
    tokenizer, vae = args.pop("tokenizer", None), args.pop("vae", None)
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ValueError(f"unknown wamrt Serve args: {unknown}")
    config = ServeConfig(model_name=model, **args)
    dep = serve.deployment(PolicyReplica, name="PolicyReplica")
    return dep.bind(model, device, gpus, parallel, dataclasses.asdict(config), tokenizer, vae)


def run(args: argparse.Namespace, config: ServeConfig) -> int:
    """`wamrt serve --ray`: join the Ray cluster at $RAY_ADDRESS (or start a local one) and deploy."""
    import ray
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    per_replica = float(args.gpus) if device.startswith("cuda") else 0.0
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                       "NVSHMEM_DISABLE_NVLS": "1"}})
    serve.start(http_options={"host": config.host, "port": config.port})
    opts = deployment_options(replicas=args.replicas, max_replicas=args.max_replicas, gpus_per_replica=per_replica,
                              max_batch=config.max_batch)
    serve.run(application(str(args.model), device=device, gpus=args.gpus, parallel=args.parallel,
                          serve_config=config, tokenizer=args.tokenizer, vae=args.vae, **opts),
              name="wamrt", route_prefix="/")
    print(f"wamrt on Ray Serve: {args.replicas} replica(s) at http://{config.host}:{config.port} (Ctrl-C stops)",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
