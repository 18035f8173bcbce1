"""Where the parts of a checkpoint folder are: `resolve_layout(folder)` -> `CheckpointLayout`.

Folders read as they are (no flag, no symlink):

* **diffusers pipeline** (`Cosmos3OmniPipeline.save_pretrained`): `model_index.json`, `transformer/`, `vae/`,
  `text_tokenizer/`, `scheduler/`, optionally `sound_tokenizer/`; any component may be sharded with an index.
* **hub repository** (NVIDIA's export): the pipeline folder plus the framework's root `config.json`, the
  tokenizer files at the root, `vision_encoder/`, and a root `model.safetensors.index.json` whose `weight_map`
  points into `transformer/*.safetensors` and `vision_encoder/*.safetensors` (keys bare or prefixed with
  `transformer.` / `vision_encoder.`, as NVIDIA's loader strips them).
* **wamrt's own** (built-in models, `wamrt train`): `transformer/`, `vae/`, `tokenizer/`, `wamrt.json`.
* **a bare transformer folder** (`config.json` + safetensors), the tokenizer and VAE inside it or beside it
  (`../tokenizer`, `../text_tokenizer`, `../vae`).
* **a `wamrt quantize` artifact** in the transformer's place (`recipe.json` + `manifest.json`).

Which index says where the transformer's tensors are: the transformer folder's own `*.safetensors.index.json`
(what diffusers reads), else the root index's entries under `transformer/` (what NVIDIA's loader reads), else
every `*.safetensors` file of the folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.checkpoint import (
    CONFIG_NAME,
    INDEX_SUFFIX,
    CheckpointError,
    read_index,
    read_json_object,
    weight_files,
)

ROOT_INDEX = "model.safetensors.index.json"
MODEL_INDEX = "model_index.json"
POLICY_CONFIG = "wamrt.json"
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_FLAG = "pass --tokenizer DIR (Python: load_policy(..., tokenizer=DIR))"
VAE_FLAG = "pass --vae DIR (Python: load_policy(..., vae=DIR))"


@dataclass(frozen=True)
class CheckpointLayout:
    """The resolved parts of one checkpoint folder; a path is None where the folder has no such part.

    root: the folder given. kind: "diffusers" (model_index.json), "hub" (a root weight index), "wamrt" (our own
    folders), "transformer" (a bare transformer folder) or "quantized" (a `wamrt quantize` artifact).
    transformer / transformer_config: the transformer's folder and its config.json.
    transformer_index: the safetensors index whose map `transformer_weights()` follows (None: the folder's files).
    quantized: the artifact folder when the transformer is a `wamrt quantize` artifact (loaded by `wamrt.quant`).
    vae, tokenizer, sound_tokenizer: component folders (diffusers layout; the tokenizer a Hugging Face one).
    scheduler: scheduler/scheduler_config.json (`scheduler_defaults` says which fields are honoured).
    model_index: diffusers' model_index.json. policy_config: wamrt.json (contract options).
    vision_encoder: the Reasoner's vision tower folder; vision_encoder_shards: its safetensors files, listed by
    the root index when there is one (`vision_encoder_weights()` maps tensor -> shard). Nothing loads it yet.
    """

    root: Path
    kind: str
    transformer: Path
    transformer_config: Path
    transformer_index: Path | None = None
    quantized: Path | None = None
    vae: Path | None = None
    tokenizer: Path | None = None
    scheduler: Path | None = None
    model_index: Path | None = None
    vision_encoder: Path | None = None
    vision_encoder_shards: tuple[Path, ...] = ()
    vision_encoder_index: Path | None = None
    sound_tokenizer: Path | None = None
    policy_config: Path | None = None

    def transformer_weights(self) -> dict[str, Path] | None:
        """Tensor name -> shard file for the transformer (None for a quantized artifact, which has its own)."""
        if self.quantized is not None:
            return None
        if self.transformer_index is None or self.transformer_index.parent == self.transformer:
            return weight_files(self.transformer)
        return _subfolder_entries(self.transformer_index, "transformer")

    def vision_encoder_weights(self) -> dict[str, Path]:
        """Tensor name -> shard file for the vision tower ({} when the checkpoint ships none)."""
        if self.vision_encoder_index is not None:
            return _subfolder_entries(self.vision_encoder_index, "vision_encoder")
        if self.vision_encoder is None:
            return {}
        return weight_files(self.vision_encoder, required=False) or {}

    def require_tokenizer(self) -> Path:
        if self.tokenizer is None:
            raise CheckpointError(f"no tokenizer in {self.root} (looked in text_tokenizer/, tokenizer/ and beside the "
                                  f"weights); {TOKENIZER_FLAG}", field="tokenizer")
        return self.tokenizer

    def require_vae(self) -> Path:
        if self.vae is None:
            raise CheckpointError(f"no vae/ folder in {self.root}; {VAE_FLAG}", field="vae")
        return self.vae


def _is_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _first(candidates: list[Path], test: Any) -> Path | None:
    return next((c for c in candidates if test(c)), None)


def _subfolder_entries(index: Path, subfolder: str) -> dict[str, Path]:
    """The entries of a root index whose shard lies in `subfolder/`, keys without a `subfolder.` prefix; a listed
    shard that is missing is named with the index that lists it."""
    out: dict[str, Path] = {}
    for key, rel in read_index(index).items():
        if rel.replace("\\", "/").startswith(subfolder + "/"):
            out[key.removeprefix(subfolder + ".")] = index.parent / rel
    for shard in sorted(set(out.values())):
        if not shard.is_file():
            raise CheckpointError(f"lists {shard.relative_to(index.parent)}, which is missing", file=index,
                                  field="weight_map")
    return out


def _root_index_points_into(index: Path, subfolder: str) -> bool:
    try:
        return any(rel.replace("\\", "/").startswith(subfolder + "/") for rel in read_index(index).values())
    except CheckpointError:
        return False


def _checked_folder(path: str | Path, flag: str, marker: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"no such folder: {folder}", field=flag)
    if not (folder / marker).is_file() and not (marker == "tokenizer" and _is_tokenizer(folder)):
        want = " or ".join(TOKENIZER_FILES) if marker == "tokenizer" else marker
        raise CheckpointError(f"{folder} has no {want}", field=flag)
    return folder


def resolve_layout(path: str | Path, *, tokenizer: str | Path | None = None,
                   vae: str | Path | None = None) -> CheckpointLayout:
    """Find the parts of the checkpoint at `path` (a folder of any layout in the module docstring). `tokenizer` /
    `vae` override where those come from (`--tokenizer` / `--vae`). Raises CheckpointError naming the file or
    the flag; a missing tokenizer or VAE is left None here (`require_tokenizer` / `require_vae` say so)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"no checkpoint at {root}", field="model")
    if (root / "transformer" / CONFIG_NAME).is_file():
        transformer, base = root / "transformer", root
    elif (root / CONFIG_NAME).is_file() and (any(root.glob("*.safetensors")) or any(root.glob("*" + INDEX_SUFFIX))):
        transformer, base = root, root.parent
    else:
        raise CheckpointError(f"{root}: no transformer (expected transformer/{CONFIG_NAME}, or {CONFIG_NAME} with "
                              "safetensors weights)", field="model")
    quantized = transformer if (transformer / "recipe.json").is_file() and (transformer / "manifest.json").is_file() \
        else None
    root_index = base / ROOT_INDEX if transformer == base / "transformer" and (base / ROOT_INDEX).is_file() else None
    own_index = sorted(transformer.glob("*" + INDEX_SUFFIX))
    transformer_index: Path | None = None
    if quantized is None:
        if own_index:
            transformer_index = own_index[0]
        elif root_index is not None and _root_index_points_into(root_index, "transformer"):
            transformer_index = root_index
    vision = base / "vision_encoder"
    vision_index = root_index if root_index is not None and _root_index_points_into(root_index, "vision_encoder") \
        else None
    if vision_index is not None:
        vision_shards = tuple(sorted({vision_index.parent / rel for rel in read_index(vision_index).values()
                                      if rel.replace("\\", "/").startswith("vision_encoder/")}))
    else:
        vision_shards = tuple(sorted(vision.glob("*.safetensors"))) if vision.is_dir() else ()
    tokenizer_dir = (_checked_folder(tokenizer, "--tokenizer", "tokenizer") if tokenizer is not None else
                     _first([base / "text_tokenizer", base / "tokenizer", transformer, base], _is_tokenizer))
    vae_dir = (_checked_folder(vae, "--vae", CONFIG_NAME) if vae is not None else
               _first([base / "vae", transformer / "vae"], lambda p: (p / CONFIG_NAME).is_file()))
    model_index = base / MODEL_INDEX if (base / MODEL_INDEX).is_file() else None
    if quantized is not None:
        kind = "quantized"
    elif transformer == root:
        kind = "transformer"
    elif root_index is not None and (transformer_index == root_index or vision_index is not None):
        kind = "hub"
    else:
        kind = "diffusers" if model_index is not None else "wamrt"
    return CheckpointLayout(
        root=root, kind=kind, transformer=transformer, transformer_config=transformer / CONFIG_NAME,
        transformer_index=transformer_index, quantized=quantized, vae=vae_dir, tokenizer=tokenizer_dir,
        scheduler=base / SCHEDULER_CONFIG if (base / SCHEDULER_CONFIG).is_file() else None,
        model_index=model_index, vision_encoder=vision if vision.is_dir() else None,
        vision_encoder_shards=vision_shards, vision_encoder_index=vision_index,
        sound_tokenizer=_first([base / "sound_tokenizer"], lambda p: (p / CONFIG_NAME).is_file()),
        policy_config=_first(list(dict.fromkeys([root / POLICY_CONFIG, transformer / POLICY_CONFIG,
                                                 base / POLICY_CONFIG])), Path.is_file),
    )


# ------------------------------------------------------------------------------------------------
# Sampler defaults from the scheduler config

# UniPC options that reshape the flow sigmas: the runtime's UniPC reproduces none of them.
_UNREPRODUCED_SIGMAS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


@dataclass(frozen=True)
class SchedulerDefaults:
    """What a checkpoint's scheduler config sets: `shift` (None: the recipe's own), where it came from, and what
    was not honoured (said in the log and, through the policy, in `wamrt infer`'s output)."""

    shift: float | None = None
    source: str | None = None
    notes: tuple[str, ...] = ()


def scheduler_defaults(layout: CheckpointLayout) -> SchedulerDefaults:
    """Fields honoured: `flow_shift` of a flow `UniPCMultistepScheduler` (`use_flow_sigmas`, none of the Karras /
    exponential / beta sigma options) becomes the default shift of policy requests and world generation. Not
    honoured, with a note: a UniPC config with Karras-type sigmas (NVIDIA's converter writes one; every diffusers
    Cosmos 3 example overrides it with flow_shift 10 and no Karras sigmas, as the recipes here do). No diffusers
    scheduler config carries a step count: steps stay the recipe's (a distilled checkpoint's `distilled_sigmas`
    fix its own, `wamrt.pipeline.world_distilled`). A FlowMatchEuler config belongs to the distilled sampler."""
    path = layout.scheduler
    if path is None:
        return SchedulerDefaults()
    cfg = read_json_object(path, "scheduler config")
    cls = cfg.get("_class_name")
    if cls != "UniPCMultistepScheduler":
        return SchedulerDefaults()
    reshaped = [k for k in _UNREPRODUCED_SIGMAS if cfg.get(k)]
    if not cfg.get("use_flow_sigmas") or reshaped:
        why = f"{reshaped[0]}=true" if reshaped else "use_flow_sigmas is not set"
        return SchedulerDefaults(notes=(f"{path}: {why} is not reproduced; the recipe's shift runs "
                                        "(--shift chooses another)",))
    shift = cfg.get("flow_shift", 1.0)
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not math.isfinite(shift) or shift <= 0:
        raise CheckpointError(f"must be a finite number > 0, got {shift!r}", file=path, field="flow_shift")
    return SchedulerDefaults(shift=float(shift), source=f"{path} flow_shift")


# ------------------------------------------------------------------------------------------------
# Configs that must agree with each other

def check_components(layout: CheckpointLayout, model_config: Any, *, vae_z_dim: int | None = None,
                     max_token_id: int | None = None, action_columns: int | None = None,
                     domain_id: int | None = None) -> None:
    """One-line CheckpointErrors, naming the file and field, where the transformer's config disagrees with the
    VAE (latent channels), the tokenizer (the ids of an empty caption's chat template and special tokens must
    have embedding rows) or the task contract (action width, embodiment domain)."""
    cfg_file = layout.transformer_config
    if vae_z_dim is not None and vae_z_dim != model_config.latent_channel:
        raise CheckpointError(f"{model_config.latent_channel}, but the VAE's z_dim is {vae_z_dim} "
                              f"({layout.vae}/config.json)", file=cfg_file, field="latent_channel")
    if max_token_id is not None and max_token_id >= model_config.vocab_size:
        raise CheckpointError(f"{model_config.vocab_size}, but the tokenizer ({layout.tokenizer}) makes token id "
                              f"{max_token_id} for an empty caption", file=cfg_file, field="vocab_size")
    if action_columns is not None and model_config.action_gen:
        if (model_config.action_dim or 0) < action_columns:
            raise CheckpointError(f"{model_config.action_dim}, but the DROID contract needs {action_columns} action "
                                  "columns", file=cfg_file, field="action_dim")
        if domain_id is not None and model_config.num_embodiment_domains <= domain_id:
            raise CheckpointError(f"{model_config.num_embodiment_domains}, but the DROID contract uses domain "
                                  f"{domain_id}", file=cfg_file, field="num_embodiment_domains")
