"""Quantized artifacts: a folder that loads straight into a quantized model.

    config.json                          model config (diffusers field names)
    recipe.json                          the recipe, the exact module selection, provenance
    model-00001-of-0000N.safetensors     quantized weights + scales, and every untouched tensor
    model.safetensors.index.json         tensor -> shard
    manifest.json                        sha256 + size of every other file (written last)

Loading checks the manifest before anything is parsed, then builds the model on the meta device,
applies the recorded recipe to that skeleton, checks that the recorded selection and every tensor's
name/shape/dtype match it, and only then materialises tensors on the target device.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .. import __version__
from ..model import ConfigError, Cosmos3Config, Cosmos3Transformer
from ..model.checkpoint import FP32_PREFIXES, split_shards
from .errors import ArtifactError, ArtifactMismatchError, ArtifactMissingFileError, RecipeError
from .fp8 import FP8
from .manifest import MANIFEST_NAME, read_json, sha256_file, verify_manifest, write_manifest
from .recipes import RECIPES, Recipe, get_recipe
from .swap import RECIPE_ATTR, quantize_model, quantized_modules, set_kernel

FORMAT = "wamrt-quant-artifact"
VERSION = 1
CONFIG_NAME, RECIPE_NAME, INDEX_NAME = "config.json", "recipe.json", "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 << 30
_QUANT_DTYPES = {"weight": (FP8, torch.int8), "weight_scale": (torch.float32,)}


def is_artifact(path: str | Path) -> bool:
    p = Path(path)
    return (p / RECIPE_NAME).is_file() and (p / MANIFEST_NAME).is_file()


# Writing -----------------------------------------------------------------------------------------


def write_artifact(model: Cosmos3Transformer, recipe: str | Recipe, out_dir: str | Path, *,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                   source: str | None = None) -> Path:
    """Write `model` quantized per `recipe` to `out_dir`. An unquantized model is quantized in place
    first; a model quantized with another recipe is refused. The folder appears complete or not at all
    (written next to it, then renamed)."""
    rec = get_recipe(recipe)
    applied = getattr(model, RECIPE_ATTR, None)
    if applied is None:
        quantize_model(model, rec)
    elif applied != rec.name:
        raise RecipeError(f"model is quantized with {applied!r}, not {rec.name!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        shards = split_shards(state, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt", "wamrt_recipe": rec.name})
            weight_map.update({k: name for k in shard})
        (tmp / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")
        cfg = {"_class_name": "Cosmos3OmniTransformer", **model.config.to_dict()}
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        modules = {n: ("fp8-w8a8" if m.weight.dtype == FP8 else "int8-w8a16")
                   for n, m in quantized_modules(model).items()}
        fused = any(n.endswith(("add_qkv_proj", "gate_up_proj")) for n, _ in model.named_modules())
        meta = {
            "format": FORMAT, "version": VERSION, "recipe": rec.to_dict(), "fused": fused, "modules": modules,
            "config_sha256": sha256_file(tmp / CONFIG_NAME), "dtype": str(model.dtype).removeprefix("torch."),
            "calibration": None,  # dynamic activation scales: no calibration data enters the artifact
            "source": source, "wamrt": __version__, "torch": torch.__version__,
        }
        (tmp / RECIPE_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        write_manifest(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# Loading -----------------------------------------------------------------------------------------
def _check_recipe(folder: Path, meta: dict, expect: str | None) -> Recipe:
    f = folder / RECIPE_NAME
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ArtifactMismatchError(f, f"not a {FORMAT} v{VERSION} recipe file "
                                       f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    try:
        rec = Recipe.from_dict(meta["recipe"])
    except (KeyError, TypeError, RecipeError) as e:
        raise ArtifactMismatchError(f, f"invalid recipe ({e})") from e
    known = RECIPES.get(rec.name)
    if known is not None and known.to_dict() != rec.to_dict():
        raise ArtifactMismatchError(f, f"recipe {rec.name!r} differs from this wamrt's definition of it "
                                       "(written by another version?); re-quantize")
    if expect is not None and rec.name != expect:
        raise ArtifactMismatchError(f, f"artifact recipe is {rec.name!r}, expected {expect!r}")
    return rec


def _read_config(folder: Path, meta: dict) -> Cosmos3Config:
    f = folder / CONFIG_NAME
    if sha256_file(f) != meta.get("config_sha256"):
        raise ArtifactMismatchError(f, "config.json is not the one recipe.json was written with")
    try:
        return Cosmos3Config.from_dict(read_json(f))
    except (ConfigError, TypeError) as e:
        raise ArtifactMismatchError(f, str(e)) from e


def _expected_dtype_ok(name: str, t: torch.Tensor, quantized: set[str]) -> bool:
    owner, _, attr = name.rpartition(".")
    if owner in quantized and attr in _QUANT_DTYPES:
        return t.dtype in _QUANT_DTYPES[attr]
    return t.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))


def load_artifact(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, *,
    kernel: str = "auto", expect_recipe: str | None = None, verify: bool = True,
) -> Cosmos3Transformer:
    """Load a quantized artifact. Untouched float tensors go to `dtype` (the time MLP stays fp32, as in
    `load_transformer`); quantized weights and scales keep their stored dtypes."""
    folder = Path(path)
    if not folder.is_dir():
        raise ArtifactMissingFileError(folder, "artifact folder does not exist")
    if verify:
        verify_manifest(folder)  # before any file is parsed
    for name in (RECIPE_NAME, CONFIG_NAME, INDEX_NAME):
        if not (folder / name).is_file():
            raise ArtifactMissingFileError(folder / name, "required artifact file is missing")
    meta = read_json(folder / RECIPE_NAME)
    rec = _check_recipe(folder, meta, expect_recipe)
    cfg = _read_config(folder, meta)
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
    chosen = quantize_model(model, rec, kernel=kernel, fuse=bool(meta.get("fused", rec.fused)))
    if chosen != meta.get("modules"):
        recorded = meta.get("modules") or {}
        diff = sorted(set(chosen.items()) ^ set(recorded.items()))[:4]
        raise ArtifactMismatchError(
            folder / RECIPE_NAME, f"recipe {rec.name!r} applied to config.json selects {len(chosen)} "
            f"modules, recipe.json records {len(recorded)}; e.g. {diff}")
    expected = model.state_dict(keep_vars=True)
    quantized = set(quantized_modules(model))
    index_file = folder / INDEX_NAME
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ArtifactMismatchError(index_file, "no weight_map")
    dev = torch.device(device)
    read_device = str(dev) if dev.type == "cuda" else "cpu"
    seen: set[str] = set()
    for shard in sorted(set(weight_map.values())):
        f = folder / shard
        if not f.is_file():
            raise ArtifactMissingFileError(f, "shard listed in the index is missing")
        try:
            handle = safe_open(str(f), framework="pt", device=read_device)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ArtifactError(f, f"cannot read safetensors file ({e})") from e
        for key in handle.keys():
            if weight_map.get(key) != shard:
                raise ArtifactMismatchError(f, f"tensor {key!r} is not indexed to this shard")
            if key not in expected:
                raise ArtifactMismatchError(f, f"unexpected tensor {key!r} for {rec.name!r} and this config")
            t = handle.get_tensor(key)
            want = expected[key]
            if tuple(t.shape) != tuple(want.shape):
                raise ArtifactMismatchError(
                    f, f"tensor {key!r} has shape {list(t.shape)}, expected {list(want.shape)}")
            if not _expected_dtype_ok(key, t, quantized):
                raise ArtifactMismatchError(f, f"tensor {key!r} has dtype {t.dtype}, invalid for its module")
            if t.dtype.is_floating_point and t.dtype != FP8 and not key.endswith("weight_scale"):
                t = t.to(torch.float32 if key.startswith(FP32_PREFIXES) else dtype)
            _assign(model, key, t.to(dev))
            seen.add(key)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ArtifactMismatchError(index_file, f"{len(missing)} tensors missing, e.g. {missing[:4]}")
    set_kernel(model, kernel, dev)  # 'auto' resolved for the target device, ahead of any compile
    return model.eval().requires_grad_(False)
