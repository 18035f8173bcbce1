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
    default_shift: float | None = None  # the checkpoint scheduler config's flow_shift; None: the recipe's (10)

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


def checkpoint_layout(checkpoint: str) -> Any | None:
    """The `CheckpointLayout` of a served checkpoint folder or built-in model; None for `random:` models, names
    that are no folder, and folders without a transformer (the loader has said what is wrong with those)."""
    from ..model import CheckpointError
    from ..pipeline.builtin import BUILTIN_MODELS
    from ..pipeline.layout import resolve_layout
    from ..pipeline.policy import checkpoint_root

    if not checkpoint or checkpoint.startswith("random:") or (
            not Path(checkpoint).exists() and checkpoint not in BUILTIN_MODELS):
        return None
    try:
        return resolve_layout(checkpoint_root(checkpoint))
    except CheckpointError:
        return None


def find_sound_tokenizer(checkpoint: str) -> Path | None:
    """`sound_tokenizer/` of a checkpoint folder (or of the folder above a bare transformer folder), or of a
    built-in model; None if there is none."""
    layout = checkpoint_layout(checkpoint)
    return None if layout is None else layout.sound_tokenizer


def world_model_of(policy: Any, checkpoint: str, sampler: str = "auto", *,
                   step_segments: int = 1) -> WorldModel | None:
    """The served policy's (or fast engine's) model/encoder/tokenizer as a `WorldModel`; None when it has none
    (a stand-in policy, a multi-GPU policy front end); a multi-GPU world layout's (`--parallel ulysses`,
    `cfg,ulysses`) generates on its `world_front`. The sound tokenizer is loaded only for a transformer with
    sound heads, from the loaded checkpoint (`policy.name`) or else the served one (`checkpoint`); the sampler
    is `resolve_sampler(sampler, checkpoint)`; the default flow shift is the checkpoint's scheduler config's when
    it sets one (`scheduler_defaults`); `step_segments` is the `WorldEngine`'s (capped at the layers)."""
    front = getattr(policy, "world_front", None)  # a multi-GPU world layout (`parallel.world_front.WorldFront`)
    if front is not None:
        policy = front
    if not all(hasattr(policy, a) for a in ("model", "encoder", "tokenizer")):
        return None
    schedule = resolve_sampler(sampler, checkpoint)
    names = dict.fromkeys(n for n in (str(getattr(policy, "name", "") or ""), checkpoint) if n)
    layouts = [layout for layout in map(checkpoint_layout, names) if layout is not None]
    sound = None
    if getattr(policy.model.config, "sound_gen", False):
        folder = next((layout.sound_tokenizer for layout in layouts if layout.sound_tokenizer is not None), None)
        if folder is not None:
            from ..pipeline.omni import model_device
            from ..pipeline.sound import SoundDecoder, load_sound_tokenizer

            sound = SoundDecoder(load_sound_tokenizer(folder, device=model_device(policy.model)))
    shift = None
    if layouts:
        from ..pipeline.layout import scheduler_defaults

        shift = scheduler_defaults(layouts[0]).shift
    return WorldModel(policy.model, policy.encoder, policy.tokenizer, sound, schedule,
                      front or _world_engine(policy, step_segments), default_shift=shift)


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
