"""One engine over several GPUs of one host: rank 0 in the calling process, ranks 1.. as workers.

`start(...)` spawns the workers (torch.multiprocessing, 'spawn'), joins the default process group as
rank 0, builds rank 0's engine, waits for every worker's engine, and returns a `ParallelPolicy`: the
same `infer_batch` / `infer` / `metadata` contract as `Engine`, so the server, the batcher and the
benchmarks use it unchanged. Each `infer_batch` first sends the batch's inputs (observations, resolved
seeds, overrides) to every worker over a pipe; then all ranks run the same engine call, meeting in the
collectives; rank 0's result is the answer.

Modes: "cfg" (2 ranks, one CFG branch each, full model per rank; `CfgParallelEngine`) and "tp" (n
ranks, every layer's heads and MLP hidden split; `wamrt.parallel.tp`) serve policy requests over the ranks.
The world-generation modes "ulysses" (n ranks on one branch's sequence) and "cfg,ulysses" (2 CFG branches ×
n / 2 sequence shares) run world generation over the ranks (`parallel.world`, `parallel.world_front`: the
`ParallelPolicy.world_front` a server generates with) and policy requests on rank 0 alone, with its own `Engine`.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.multiprocessing as mp

from ..net import free_port
from . import dist as pdist

log = logging.getLogger("wamrt.parallel")
MODES = ("cfg", "tp", "ulysses", "cfg,ulysses")
WORLD_MODES = ("ulysses", "cfg,ulysses")  # world generation over the ranks (`parallel.world`)


@dataclass
class ParallelSpec:
    """What every rank builds. `model`: a checkpoint folder, a built-in name or `random:SIZE`."""

    mode: str
    model: str
    world: int = 2
    device: str = "cuda"  # "cuda" = one GPU per rank (NCCL); "cpu" = gloo (tests)
    dtype: str | None = None  # "bfloat16" / "float32"; default bf16 on CUDA, fp32 on CPU
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    layers: int | None = None  # random:SIZE only: override the layer count (smoke tests)
    tiny_vae: bool = False  # random:SIZE only
    # random:SIZE only: "fixed" = performance.md's 125 / 30 tokens (timing), "variable" = the count follows the
    # text (serving, like `load_policy("random:SIZE")`); see pipeline.random_weights
    tokenizer: str = "fixed"
    # A checkpoint folder: the tokenizer / VAE folders that replace its own (`--tokenizer` / `--vae`); every rank
    # resolves the same layout with them (`pipeline.layout.resolve_layout`).
    tokenizer_dir: str | None = None
    vae_dir: str | None = None
    seed: int = 0
    # World modes: EngineConfig fields over `WORLD_ENGINE_CONFIG` for the world engine (attention, compile,
    # compile_mode and cuda_graph come from `engine` unless set here, as a one-GPU server's WorldEngine takes them
    # from its policy engine), and its step segments.
    world_engine: dict[str, Any] = field(default_factory=dict)
    step_segments: int = 1

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_policy(spec: ParallelSpec, rank: int, device: torch.device):
    """This rank's Policy: the full model (cfg) or this rank's TP shard; VAE and tokenizer replicated."""
    from ..pipeline.denoise import SamplingOptions
    from ..pipeline.droid import DroidContract
    from ..pipeline.policy import Policy, load_policy

    dtype = spec.torch_dtype(device)
    name = spec.model
    if name.startswith("random:"):
        from ..pipeline.random_weights import random_tokenizer, random_transformer, random_vae
        from ..pipeline.vae import FrameEncoder

        size = name.split(":", 1)[1]
        if spec.mode == "tp":
            from .tp import random_sharded

            model = random_sharded(size, rank, spec.world, device, dtype, layers=spec.layers, seed=spec.seed)
        else:
            model = random_transformer(size, device, dtype, layers=spec.layers, seed=spec.seed)
        encoder = FrameEncoder(random_vae(device, dtype, tiny=spec.tiny_vae or size.startswith("tiny")))
        tok = random_tokenizer(spec.tokenizer, model.config.vocab_size)
        return Policy(model, encoder, tok, DroidContract(), SamplingOptions(),  # type: ignore[arg-type]
                      name=f"{size} (random weights)")
    from ..pipeline.builtin import BUILTIN_MODELS

    sliced = spec.mode == "tp" and name not in BUILTIN_MODELS

    def read_slices(layout, dev: torch.device, dt: torch.dtype):  # noqa: ANN001, ANN202 - CheckpointLayout
        from .tp import load_sharded

        return load_sharded(layout.transformer, rank, spec.world, dev, dt, weights=layout.transformer_weights())

    # A checkpoint folder under "tp": only this rank's slices of the transformer are read.
    policy = load_policy(name, device=device, dtype=dtype, tokenizer=spec.tokenizer_dir, vae=spec.vae_dir,
                         transformer_loader=read_slices if sliced else None)
    if spec.mode == "tp" and not sliced:  # a built-in (tiny) model: loaded whole, this rank's shard kept
        from .tp import shard_model

        shard_model(policy.model, rank, spec.world)
    return policy


def world_config(spec: ParallelSpec):
    """The world engine's configuration in a world mode."""
    from ..engine.world import WORLD_ENGINE_CONFIG

    shared = {k: spec.engine[k] for k in ("attention", "compile", "compile_mode", "cuda_graph")
              if k in spec.engine}
    return replace(WORLD_ENGINE_CONFIG, **{**shared, **spec.world_engine})


def build_engine(spec: ParallelSpec, policy, rank: int):
    """This rank's engine: the policy engine of "cfg" / "tp", or the `ParallelWorldEngine` of a world mode (whose
    process subgroups are made here: every rank calls this in the same order)."""
    from ..engine import Engine, EngineConfig

    if spec.mode in WORLD_MODES:
        from .world import ParallelWorldEngine, WorldGroups, WorldLayout

        layout = WorldLayout.of(spec.mode, spec.world)
        return ParallelWorldEngine(policy.model, policy.encoder, policy.tokenizer, world_config(spec), layout=layout,
                                   groups=WorldGroups.make(layout), name=policy.name,
                                   step_segments=min(spec.step_segments, len(policy.model.layers)))
    config = EngineConfig(**spec.engine)
    if spec.mode == "cfg":
        from .cfg import CfgParallelEngine

        return CfgParallelEngine.from_policy(policy, config)
    engine = Engine.from_policy(policy, config)
    return engine


def fingerprint(model: torch.nn.Module) -> float:
    """A cheap digest of the replicated weights (ranks must agree on them)."""
    with torch.no_grad():
        return float(model.proj_in.weight.double().sum() + model.embed_tokens.weight[:64].double().sum())


def _worker(rank: int, spec: ParallelSpec, port: int, conn: mpc.Connection) -> None:
    pdist.no_multicast_env()
    try:
        device = pdist.rank_device(spec.device, rank)
        pdist.init_group(rank, spec.world, port, device)
        policy = build_policy(spec, rank, device)
        engine = build_engine(spec, policy, rank)
        conn.send(("ready", fingerprint(policy.model)))
    except BaseException:  # noqa: BLE001  # report any start-up failure to rank 0, then exit
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "infer_batch":
                _, observations, seeds, resolved, overrides = msg
                for s in seeds:  # keep this engine's seed stream (and its noise prefetch) in step with rank 0's
                    if s is None:
                        engine.next_seed()
                try:
                    engine.infer_batch(observations, seeds=resolved, **overrides)
                except Exception:  # noqa: BLE001  # rank 0 raised the same (validation): it reports it
                    log.debug("worker %d: request failed", rank, exc_info=True)
            elif msg[0] == "world":
                from .world_front import follow_world_request

                try:
                    follow_world_request(engine, msg, device)
                except Exception:  # noqa: BLE001  # rank 0 met the same error (same inputs): it reports it
                    log.debug("worker %d: world request failed", rank, exc_info=True)
            elif msg[0] == "memory":
                conn.send(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        pdist.close_group()


class ParallelPolicy:
    """Rank 0's view: the engine contract, with every call mirrored on the worker ranks."""

    def __init__(self, spec: ParallelSpec, engine: Any, policy: Any, procs: list, conns: list,
                 world_engine: Any = None) -> None:
        self.spec, self.engine, self.policy = spec, engine, policy
        self._procs, self._conns = procs, conns
        self.name = engine.name
        self.world_front = None  # world modes: world generation over every rank (`WorldFront`)
        if world_engine is not None:
            from .world_front import WorldFront

            self.world_front = WorldFront(world_engine, conns, self._check_workers)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def tokenizer(self) -> Any:  # the server counts prompt tokens with it (reply metadata.prompt_tokens)
        return self.engine.tokenizer

    def _check_workers(self) -> None:
        dead = [p.pid for p in self._procs if not p.is_alive()]
        if dead:
            from ..serving.errors import ServingError

            raise ServingError(f"parallel worker process(es) {dead} exited; restart the server")

    def infer_batch(self, observations: list[Mapping[str, Any]], *, seeds: list[int | None] | None = None,
                    **overrides: Any) -> list:
        if self.world_front is not None:  # world modes: policy requests run on rank 0 alone
            self._check_workers()
            return self.engine.infer_batch(observations, seeds=seeds, **overrides)
        seeds = list(seeds) if seeds else [None] * len(observations)
        resolved = [self.engine.next_seed() if s is None else s for s in seeds]
        self._check_workers()
        msg = ("infer_batch", list(observations), seeds, resolved, overrides)
        for c in self._conns:
            c.send(msg)
        return self.engine.infer_batch(observations, seeds=resolved, **overrides)

    def infer(self, observation: Mapping[str, Any], *, seed: int | None = None, **overrides: Any):
        result = self.infer_batch([observation], seeds=[seed], **overrides)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def metadata(self) -> dict[str, Any]:
        meta = self.engine.metadata()
        meta["engine"] = {**meta.get("engine", {}), "parallel": self.spec.mode, "gpus": self.spec.world}
        return meta

    def peak_memory_gib(self) -> list[float | None]:
        """Peak allocated memory per rank (GiB), rank 0 first."""
        out: list[float | None] = [torch.cuda.max_memory_allocated(self.device) / 2**30
                                   if self.device.type == "cuda" else None]
        for c in self._conns:
            c.send(("memory",))
            out.append(c.recv())
        return out

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        pdist.close_group()

    def __enter__(self) -> ParallelPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join_watching(world: int, port: int, device: torch.device, procs: list, timeout: float) -> None:
    """Join the group as rank 0 on a helper thread, failing fast if a worker dies before it joins
    (the rendezvous itself would wait for the whole collective timeout)."""
    import threading

    failure: list[BaseException] = []

    def join() -> None:
        try:
            pdist.init_group(0, world, port, device)
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    t = threading.Thread(target=join, name="wamrt-rendezvous", daemon=True)
    t.start()
    end = time.monotonic() + timeout
    while t.is_alive():
        t.join(0.5)
        dead = [p for p in procs if not p.is_alive()]
        if dead and t.is_alive():
            raise RuntimeError(f"worker {dead[0].name} exited with code {dead[0].exitcode} before joining the group")
        if time.monotonic() > end:
            raise RuntimeError("process group rendezvous timed out")
    if failure:
        raise failure[0]


def start(spec: ParallelSpec, *, policy: Any = None, timeout: float = 1800.0) -> ParallelPolicy:
    """Spawn ranks 1..world-1, join as rank 0 and build every rank's engine. `policy`: rank 0's
    already-built Policy (cfg mode; e.g. a benchmark that measured it on one GPU first)."""
    if spec.mode not in MODES:
        raise ValueError(f"parallel mode must be one of {MODES}, got {spec.mode!r}")
    if spec.mode == "cfg" and spec.world != 2:
        raise ValueError("--parallel cfg runs on exactly 2 GPUs")
    if spec.device.startswith("cuda") and torch.cuda.device_count() < spec.world:
        raise ValueError(f"{spec.world} GPUs requested, {torch.cuda.device_count()} visible")
    pdist.no_multicast_env()
    from ..pipeline.builtin import BUILTIN_MODELS, builtin_path

    if spec.model in BUILTIN_MODELS:
        builtin_path(spec.model)  # build the cached folder once here, not racing in every rank
    if not spec.model.startswith("random:"):  # a folder that cannot serve is one line, before any rank starts
        from ..pipeline.layout import resolve_layout
        from ..pipeline.policy import checkpoint_root

        layout = resolve_layout(checkpoint_root(spec.model), tokenizer=spec.tokenizer_dir, vae=spec.vae_dir)
        layout.require_tokenizer()
        layout.require_vae()
        if spec.mode == "tp" and layout.quantized is not None:
            raise ValueError(f"{spec.model} is a `wamrt quantize` artifact; tp reads the slices of an unquantized "
                             "checkpoint folder")
    if spec.mode in WORLD_MODES:  # a layout that does not fit fails here, in one line, before any rank starts
        from .world import WorldLayout

        cfg = model_config(spec)
        WorldLayout.of(spec.mode, spec.world).check(cfg.num_attention_heads, cfg.num_key_value_heads)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, spec.world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, spec, port, child), name=f"wamrt-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        device = pdist.rank_device(spec.device, 0)
        _join_watching(spec.world, port, device, procs, timeout)
        if policy is None:
            policy = build_policy(spec, 0, device)
        elif spec.mode == "tp":
            raise ValueError("tp: rank 0's policy is built here (it is a shard)")
        engine = build_engine(spec, policy, 0)
        world_engine = None
        if spec.mode in WORLD_MODES:  # rank 0 serves policy requests alone, on an engine of its own
            from ..engine import Engine, EngineConfig

            world_engine, engine = engine, Engine.from_policy(policy, EngineConfig(**spec.engine))
        mine = fingerprint(policy.model)
        end = time.monotonic() + timeout
        for rank, c in enumerate(conns, start=1):
            while not c.poll(1.0):
                if not procs[rank - 1].is_alive() or time.monotonic() > end:
                    raise RuntimeError(f"rank {rank} did not start (exit code {procs[rank - 1].exitcode})")
            status, info = c.recv()
            if status != "ready":
                raise RuntimeError(f"rank {rank} failed to start:\n{info}")
            if abs(info - mine) > 1e-6 * max(1.0, abs(mine)):
                raise RuntimeError(f"rank {rank} built different replicated weights than rank 0 ({info} vs {mine})")
    except BaseException:
        for p in procs:
            p.kill()
        pdist.close_group()
        raise
    log.info("parallel %s over %d ranks ready (%s)", spec.mode, spec.world, asdict(spec))
    return ParallelPolicy(spec, engine, policy, procs, conns, world_engine)


def model_config(spec: ParallelSpec):
    """The transformer configuration `spec.model` names (`random:SIZE[@RECIPE]`, a folder in any layout
    `resolve_layout` reads, a built-in or trained model name), read without its weights."""
    from ..model import get_config
    from ..model.checkpoint import read_config
    from ..pipeline.layout import resolve_layout
    from ..pipeline.policy import checkpoint_root

    if spec.model.startswith("random:"):
        return get_config(spec.model.split(":", 1)[1].partition("@")[0])
    return read_config(resolve_layout(checkpoint_root(spec.model)).transformer)


__all__ = ["MODES", "WORLD_MODES", "ParallelPolicy", "ParallelSpec", "build_engine", "build_policy", "model_config",
           "start"]
