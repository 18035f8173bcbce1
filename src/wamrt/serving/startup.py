"""`wamrt serve` on one GPU, failing fast: the checkpoint folder and the port are checked, and the memory plan made,
before any weight loads (minutes at Nano); every startup error is one line naming the flag or file; the engine gets
the plan's batch ladder and prefix widths; one summary line says what runs (model, device, recipe, engine settings,
memory plan, load and warm-up seconds).
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import time
from pathlib import Path
from typing import Any

from ..engine.memory_plan import GIB, MemoryPlan, MemoryPlanError
from .config import ServeConfig, ServeConfigError

log = logging.getLogger("wamrt.serving")

NARROW_INSTRUCTION_TOKENS = 128  # the narrow prefix rung holds instructions of up to this many tokens


class StartupError(Exception):
    """A startup failure, said in one line that names the flag or the file."""


def check_model(name: str, *, tokenizer: str | None = None, vae: str | None = None) -> None:
    """The checkpoint folder exists and holds what it must (`pipeline.layout.resolve_layout`: a transformer config
    and weights, a tokenizer, a VAE), or `name` is a built-in / random model: before anything loads."""
    from ..model import CheckpointError, get_config
    from ..pipeline.builtin import BUILTIN_MODELS
    from ..pipeline.layout import resolve_layout
    from ..pipeline.policy import TRAINED_MODELS

    if name.startswith("random:"):
        size, _, recipe = name.removeprefix("random:").partition("@")
        try:
            get_config(size)
        except ValueError as exc:
            raise StartupError(f"--model {name}: {exc}") from None
        if recipe:
            from ..quant import RECIPES

            if recipe not in RECIPES:
                raise StartupError(f"--model {name}: unknown recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}")
        return
    if name in BUILTIN_MODELS or name in TRAINED_MODELS:
        return
    if not Path(name).exists():
        raise StartupError(f"--model {name}: no such folder (built-in models: {', '.join(BUILTIN_MODELS)}, "
                           "random:SIZE)")
    try:
        layout = resolve_layout(name, tokenizer=tokenizer, vae=vae)
        layout.require_tokenizer()
        layout.require_vae()
    except CheckpointError as exc:
        flag = {"tokenizer": "--tokenizer", "vae": "--vae"}.get(getattr(exc, "field", None) or "", "--model")
        raise StartupError(f"{f'--model {name}' if flag == '--model' else flag}: {exc}") from None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port fails here, not after the weights load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise StartupError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def resolve_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StartupError(f"--device {device}: no CUDA device here")
    return device


def plan_memory(args: argparse.Namespace, config: ServeConfig, device: str) -> MemoryPlan | None:
    """The memory plan (CUDA, or any device given --gpu-memory), made before the weights load; the allocator capped
    to it below the device's memory. Sets config.max_batch / max_video_pixels where the flags left them to it."""
    from .memory import cap_device, make_plan

    if not device.startswith("cuda") and config.gpu_memory_gib is None:
        return None
    try:
        plan = make_plan(config, device, max_batch=args.max_batch, max_video_pixels=args.max_video_pixels,
                         tokenizer=getattr(args, "tokenizer", None), vae=getattr(args, "vae", None))
    except MemoryPlanError as exc:
        raise StartupError(f"memory plan: {exc}") from None
    except (OSError, ValueError) as exc:  # an unreadable checkpoint header
        raise StartupError(f"--model {config.model_name}: {exc}") from None
    config.max_batch = plan.settings["max_batch"]
    config.batch_ladder = tuple(plan.settings["ladder"])
    if plan.settings.get("max_video_pixels"):
        config.max_video_pixels = plan.settings["max_video_pixels"]
    config.kv_cache_bytes = plan.part("prefix_cache").nbytes
    try:
        cap = cap_device(plan, device)
    except (RuntimeError, ValueError) as exc:  # one line naming the flag; the traceback goes to the debug log
        log.debug("capping the allocator failed", exc_info=True)
        raise StartupError(f"--gpu-memory {config.gpu_memory_gib:g}: cannot cap the allocator on {device}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    log.info("memory plan: %s; max batch %d (ladder %s), prefix widths %s, world generation up to %s pixels%s",
             plan.describe(), config.max_batch, "/".join(map(str, config.batch_ladder)),
             "/".join(map(str, plan.settings["widths"])), plan.settings.get("max_video_pixels"),
             f"; allocator capped at {cap:g} GiB of {plan.device_total / GIB:.1f}" if cap else "")
    return plan


def print_plan(args: argparse.Namespace, config: ServeConfig) -> int:
    """`wamrt serve --plan-only`: the plan for the model on the device (or --gpu-memory), nothing loaded."""
    import sys

    try:
        check_model(config.model_name, tokenizer=getattr(args, "tokenizer", None), vae=getattr(args, "vae", None))
        device = resolve_device(args.device)
        plan = plan_memory(args, config, device)
    except StartupError as exc:
        print(f"wamrt serve: {exc}", file=sys.stderr)
        return 2
    if plan is None:
        print("wamrt serve: no memory plan for a CPU device without --gpu-memory", file=sys.stderr)
        return 2
    print(f"{config.model_name} on {plan.capacity / GIB:g} GiB: max batch {config.max_batch} (ladder "
          f"{'/'.join(map(str, config.batch_ladder))}), prefix widths {'/'.join(map(str, plan.settings['widths']))}, "
          f"world generation up to {plan.settings.get('max_video_pixels')} pixels; {plan.describe()}")
    return 0


def prompt_rungs(policy: Any, config: ServeConfig) -> tuple[tuple[int, ...], int]:
    """The prefix widths graphs are captured at and the most prefix tokens accepted, from the served tokenizer: the
    caption around an instruction of `NARROW_INSTRUCTION_TOKENS` tokens (or `--prompt-width`), and around one of
    `--max-prompt-tokens`, each rounded up to the bucket."""
    from ..pipeline.droid import droid_host_inputs
    from ..pipeline.prompts import droid_prompt
    from ..sample import sample_observation

    bucket = config.prompt_bucket
    if not bucket or not config.max_prompt_tokens:
        return ((config.prompt_width,) if config.prompt_width else ()), 0
    host = droid_host_inputs(sample_observation(0), policy.contract)
    canvas_h, canvas_w = host.padded.image_size[:2]
    caption = droid_prompt("a", json_format=policy.contract.prompt_format == "json", canvas_hw=(canvas_h, canvas_w))
    template = len(policy.tokenizer.encode(caption).text_ids) - 1  # the caption's tokens around a 1-token instruction

    def up(n: int) -> int:
        return -(-n // bucket) * bucket

    limit = template + config.max_prompt_tokens
    narrow = config.prompt_width or up(template + min(NARROW_INSTRUCTION_TOKENS, config.max_prompt_tokens))
    return tuple(sorted({narrow, up(limit)})), limit


def build_engine(policy: Any, config: ServeConfig, device: str) -> Any:
    """The fast engine over `policy` with the plan's ladder and the tokenizer's prefix rungs."""
    from ..engine import Engine, EngineConfig

    widths, limit = prompt_rungs(policy, config)
    config.prompt_widths, config.max_prefix_tokens = widths, limit
    try:
        settings = config.engine_settings(device)
        return Engine.from_policy(policy, EngineConfig(**settings))
    except ServeConfigError as exc:
        raise StartupError(str(exc)) from None
    except ValueError as exc:
        raise StartupError(f"--model {config.model_name}: the fast engine cannot serve it: {exc}") from None


def load(args: argparse.Namespace, config: ServeConfig) -> tuple[Any, socket.socket, dict[str, Any]]:
    """Everything before the app: checks, the port, the plan, the weights, the engine. Returns the policy (or
    engine), the bound socket and what the summary line reports. Raises StartupError."""
    from ..model import CheckpointError
    from ..pipeline.errors import RequestError
    from ..pipeline.policy import load_policy

    t0 = time.monotonic()
    check_model(config.model_name, tokenizer=getattr(args, "tokenizer", None), vae=getattr(args, "vae", None))
    sock = bind(config.host, config.port)
    try:
        device = resolve_device(args.device)
        plan = plan_memory(args, config, device)
        try:
            policy = load_policy(args.model, device=device, tokenizer=getattr(args, "tokenizer", None),
                                 vae=getattr(args, "vae", None))
        except (RequestError, CheckpointError) as exc:  # they name their file or field already
            raise StartupError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001  # one line naming the flag; the traceback goes to the debug log
            log.debug("loading %s failed", args.model, exc_info=True)
            raise StartupError(f"--model {args.model}: cannot load it: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        loaded = time.monotonic() - t0
        if args.engine == "fast" or (args.engine == "auto" and policy.device.type == "cuda"):
            policy = build_engine(policy, config, str(policy.device))
        elif (config.attention, config.epilogues) != (ServeConfig.attention, ServeConfig.epilogues):
            flag = "--attention" if config.attention != ServeConfig.attention else "--epilogues"
            raise StartupError(f"{flag}: applies to the fast engine (--engine fast, or auto on CUDA); this server runs "
                               f"the eager reference on {policy.device}")
    except BaseException:
        sock.close()
        raise
    dtype = str(getattr(getattr(policy, "model", None), "dtype", "")).removeprefix("torch.")
    info = {"model": config.model_name, "device": _device_name(device),
            "recipe": getattr(policy, "quantization", None) or dtype or "unquantized", "load_s": round(loaded, 1),
            "engine": _engine_line(policy), "plan": plan}
    if plan is not None:
        config.extra_metadata["memory_plan"] = plan.as_dict()
    return policy, sock, info


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return device
    import torch

    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def _engine_line(policy: Any) -> str:
    engine = (policy.metadata() or {}).get("engine")
    if not engine:
        return "eager reference"
    keys = ("attention", "epilogues", "prompt_bucket", "prompt_widths", "batch_ladder", "capture_on_request",
            "shared_kv_buffer", "isolate_requests")
    return ", ".join(f"{k} {engine[k]}" for k in keys if k in engine)


def summary_line(info: dict[str, Any], warmup: dict[str, Any]) -> str:
    """One line: model, device, recipe, engine settings, memory plan, load and warm-up seconds."""
    plan: MemoryPlan | None = info.get("plan")
    memory = "no plan (CPU)" if plan is None else plan.describe() + (
        f", capped at {plan.capacity / GIB:g} GiB" if plan.capped else "")
    graphs = warmup.get("graphs") or {}
    ladder = (f", graphs {graphs.get('captured', 0)}/{graphs.get('planned', 0)} captured, the rest in the background"
              if graphs.get("planned") else "")
    return (f"wamrt serve ready: {info['model']} on {info['device']}, {info['recipe']}; engine: {info['engine']}; "
            f"memory: {memory}; load {info['load_s']} s, warm-up {warmup.get('seconds')} s{ladder}")
