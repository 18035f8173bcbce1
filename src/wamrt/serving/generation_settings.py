"""What `wamrt serve` settles about world generation at startup, before a model is built: the sampler a
checkpoint is served with (`resolve_sampler`, `--sampler`) and the warm-up jobs (`warmup_fields`,
`--generation-warmup`), plus the "@sample" / "@PATH" upload convention those jobs and the benches share.

Kept apart from `generation` (the jobs themselves) so that `ServeConfig` checks these flags when it is made
without importing the job machinery, and no module of `serving` imports one that imports it back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ServeConfigError
from .media import encode_png

if TYPE_CHECKING:
    from ..sampler import DistilledSchedule

SAMPLER_CHOICES = ("auto", "unipc", "distilled")  # `wamrt serve --sampler`
_DISTILLED_PIPELINE = "Cosmos3DistilledModularPipeline"  # modular_model_index.json `_class_name`


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`: {} when there is no such file, None when it cannot be read as one."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def distilled_folder(checkpoint: str) -> Path | None:
    """The folder of a served checkpoint (its own, or the one above a bare transformer folder) that declares
    it distilled, or None.

    Declared by diffusers' `modular_model_index.json` naming `Cosmos3DistilledModularPipeline` or carrying
    `distilled_sigmas` (what that pipeline reads), or by a `FlowMatchEulerDiscreteScheduler` scheduler config
    (how vLLM-Omni tells them apart: base Cosmos 3 checkpoints ship UniPC). A file there that cannot be read
    counts as a declaration, so that `load_distilled_schedule` says what is wrong with it. Built-in and
    `random:` models are not folders and declare nothing.
    """
    if not checkpoint or not Path(checkpoint).is_dir():
        return None
    from ..pipeline.world_distilled import MODULAR_INDEX, SCHEDULER_CLASS, SCHEDULER_CONFIG

    root = Path(checkpoint)
    for folder in (root, root.parent):
        index, scheduler = _json_object(folder / MODULAR_INDEX), _json_object(folder / SCHEDULER_CONFIG)
        if index is None or scheduler is None or "distilled_sigmas" in index \
                or index.get("_class_name") == _DISTILLED_PIPELINE or scheduler.get("_class_name") == SCHEDULER_CLASS:
            return folder
    return None


def resolve_sampler(sampler: str, checkpoint: str) -> DistilledSchedule | None:
    """The world-generation sampler of `wamrt serve --sampler SAMPLER` on `checkpoint`: the distilled schedule
    to run, or None for UniPC with CFG. Errors are `ServeConfigError`s naming `--sampler`.

    auto: distilled when the checkpoint declares it (`distilled_folder`), else UniPC; unipc: UniPC even on a
    distilled checkpoint; distilled: the checkpoint's schedule, which must exist. A declared schedule that
    cannot be read fails here rather than falling back to UniPC: a distilled checkpoint sampled with 35 UniPC
    steps and CFG still produces a video, just not one it was trained to make.
    """
    if sampler not in SAMPLER_CHOICES:
        raise ServeConfigError(f"must be one of {', '.join(SAMPLER_CHOICES)}, got {sampler!r}", flag="--sampler")
    if sampler == "unipc":
        return None
    folder = distilled_folder(checkpoint)
    if folder is None:
        if sampler == "distilled":
            raise ServeConfigError(
                f"{checkpoint or 'the served model'} is not a distilled checkpoint (no modular_model_index.json with "
                "distilled_sigmas, no FlowMatchEulerDiscreteScheduler in scheduler/); serve it with --sampler auto "
                "or unipc", flag="--sampler")
        return None
    from ..pipeline.world_distilled import DistilledCheckpointError, load_distilled_schedule

    try:
        return load_distilled_schedule(folder)
    except DistilledCheckpointError as exc:
        fallback = "" if sampler == "distilled" else "; --sampler unipc serves it with UniPC anyway"
        raise ServeConfigError(f"{checkpoint} declares a distilled schedule that cannot be used: {exc}{fallback}",
                               flag="--sampler") from exc


SAMPLE_REFERENCE = "@sample"  # a field value naming the built-in picture (the sample observation's wrist view)


def sample_picture() -> bytes:
    """PNG of the sample observation's 360x640 wrist view: a table with three coloured discs."""
    from ..sample import sample_observation

    return encode_png(sample_observation(0)["observation/wrist_image_left"])


def warmup_fields(text: str) -> dict[str, Any]:
    """One `wamrt serve --generation-warmup` value -> the fields of a warm-up job: a JSON object of
    /v1/videos/sync form fields, where "@sample" is the built-in picture and "@PATH" a file's bytes (curl's -F
    convention). Raises ValueError saying what is wrong."""
    example = '{"size": "832x480", "num_frames": "33", "input_reference": "@sample"}'
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc}); expected an object such as {example}") from None
    if not isinstance(fields, dict) or not fields:
        raise ValueError(f"must be a non-empty JSON object of /v1/videos/sync fields, such as {example}")
    fields.setdefault("prompt", "A robot arm picks up the red block and places it in the blue bowl.")
    for key, value in fields.items():
        if isinstance(value, str) and value.startswith("@"):
            try:
                fields[key] = reference_upload(value)[1]
            except ValueError as exc:
                raise ValueError(f"field {key!r}: {exc}") from None
    return fields


def reference_upload(value: str) -> tuple[str, bytes]:
    """A field value "@sample" (the built-in picture) or "@PATH" -> (file name, bytes); ValueError for a missing
    file."""
    if value == SAMPLE_REFERENCE:
        return "sample.png", sample_picture()
    path = Path(value[1:])
    if not path.is_file():
        raise ValueError(f"{value[1:]!r} is not a file ({SAMPLE_REFERENCE} = the built-in picture)")
    return path.name, path.read_bytes()
