"""The served checkpoint's world-generation side (`WorldModel`): transformer, VAE, caption tokenizer, sound
tokenizer, the sampler it runs with (`generation_settings.resolve_sampler`) and, on CUDA servers, the
`WorldEngine` that shares the policy engine's weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .generation_settings import resolve_sampler

if TYPE_CHECKING:
    from ..sampler import DistilledSchedule

Sampler = Literal["unipc", "distilled"]


@dataclass(frozen=True, eq=False)
class WorldModel:
    """What generation needs from the served checkpoint: transformer, VAE (encoder + decoder), caption
    tokenizer, the sound tokenizer when the transformer has sound heads and the checkpoint ships one, and the
    distilled schedule when the checkpoint is served with the distilled sampler (`resolve_sampler`)."""

    model: Any
    encoder: Any
    tokenizer: Any
    sound: Any | None  # pipeline.sound.SoundDecoder
    schedule: DistilledSchedule | None = None  # None: UniPC with CFG (`run_world`)
    engine: Any | None = None  # a `WorldEngine` (served fast engine on CUDA), else None: the eager pipelines

    def run(self, *, on_segment: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """One request with the served sampler (`run_world`, or `run_world_distilled` with the checkpoint's
        schedule), through the engine when there is one; `on_segment` runs inside every step where the engine
        splits it (`WorldEngine.step_segments`; the eager pipelines have no such points)."""
        if self.schedule is not None:
            if self.engine is not None:
                return self.engine.run_distilled(schedule=self.schedule, on_segment=on_segment, **kwargs)
            from ..pipeline.world_distilled import run_world_distilled

            return run_world_distilled(self.model, self.encoder, self.tokenizer, schedule=self.schedule, **kwargs)
        if self.engine is not None:
            return self.engine.run(on_segment=on_segment, **kwargs)
        from ..pipeline.world import run_world

        return run_world(self.model, self.encoder, self.tokenizer, **kwargs)

    @property
    def sound_heads(self) -> bool:
        return bool(getattr(self.model.config, "sound_gen", False))

    @property
    def sampler(self) -> Sampler:
        return "unipc" if self.schedule is None else "distilled"


def find_sound_tokenizer(checkpoint: str) -> Path | None:
    """`sound_tokenizer/` of a checkpoint folder (or of the folder above a bare transformer folder), or of a
    built-in model; None if there is none."""
    from ..pipeline.builtin import BUILTIN_MODELS, builtin_path

    if not checkpoint or checkpoint.startswith("random:") or (
            not Path(checkpoint).exists() and checkpoint not in BUILTIN_MODELS):
        return None
    root = builtin_path(checkpoint) if checkpoint in BUILTIN_MODELS else Path(checkpoint)
    for folder in (root / "sound_tokenizer", root.parent / "sound_tokenizer"):
        if (folder / "config.json").is_file():
            return folder
    return None


def world_model_of(policy: Any, checkpoint: str, sampler: str = "auto", *,
                   step_segments: int = 1) -> WorldModel | None:
    """The served policy's (or fast engine's) model/encoder/tokenizer as a `WorldModel`; None when it has none
    (a stand-in policy, a multi-GPU policy front end); a multi-GPU world layout's (`--parallel ulysses`,
    `cfg,ulysses`) generates on its `world_front`. The sound tokenizer is loaded only for a transformer with
    sound heads, from the loaded checkpoint (`policy.name`) or else the served one (`checkpoint`); the sampler
    is `resolve_sampler(sampler, checkpoint)`; `step_segments` is the `WorldEngine`'s (capped at the layers)."""
    front = getattr(policy, "world_front", None)  # a multi-GPU world layout (`parallel.world_front.WorldFront`)
    if front is not None:
        policy = front
    if not all(hasattr(policy, a) for a in ("model", "encoder", "tokenizer")):
        return None
    schedule = resolve_sampler(sampler, checkpoint)
    sound = None
    if getattr(policy.model.config, "sound_gen", False):
        names = dict.fromkeys(n for n in (str(getattr(policy, "name", "") or ""), checkpoint) if n)
        folder = next((f for f in map(find_sound_tokenizer, names) if f is not None), None)
        if folder is not None:
            from ..pipeline.omni import model_device
            from ..pipeline.sound import SoundDecoder, load_sound_tokenizer

            sound = SoundDecoder(load_sound_tokenizer(folder, device=model_device(policy.model)))
    return WorldModel(policy.model, policy.encoder, policy.tokenizer, sound, schedule,
                      front or _world_engine(policy, step_segments))


def _world_engine(policy: Any, step_segments: int = 1) -> Any | None:
    """A `WorldEngine` sharing the served fast engine's model, VAE and tokenizer (its own compiled wrappers, graph
    pool and K/V arena; one of them runs at a time, see `DeviceGate`), when that engine runs CUDA graphs; else
    None (CPU servers and the eager reference policy keep `run_world`)."""
    from ..engine import Engine
    from ..engine.world import WORLD_ENGINE_CONFIG, WorldEngine

    # On the device type too: CPU tests run the policy engine's graph path with a stand-in for CUDA graphs, and a
    # WorldEngine with graphs refuses a CPU model.
    if not isinstance(policy, Engine) or not policy.config.cuda_graph or policy.device.type != "cuda":
        return None
    config = replace(WORLD_ENGINE_CONFIG, attention=policy.config.attention, compile_mode=policy.config.compile_mode)
    return WorldEngine(policy.model, policy.encoder, policy.tokenizer, config, name=policy.name,
                       step_segments=min(step_segments, len(policy.model.layers)))
