"""Read and write Cosmos 3 transformer checkpoints in the diffusers folder layout.

A folder holds `config.json` plus either one `*.safetensors` file or shards listed by a
`*.safetensors.index.json`; a caller may instead pass the key -> shard map itself (a hub repository's root
index, `wamrt.pipeline.layout`). Keys may carry a leading `model.`. The model is built on the meta
device and each tensor is materialised straight into the requested dtype on the target device, so
peak memory stays near one copy of the weights. No network access happens here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, Cosmos3Config
from .transformer import Cosmos3Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
# In the checkpoint but never read by the forward (text head of the Reasoner): skipped on load.
UNUSED_KEYS = frozenset({"lm_head.weight"})
FP32_PREFIXES = ("time_embedder.",)  # kept in float32 whatever the model dtype
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor and the file.

    `file` / `field`, when given, lead the one-line message ("<file>: <field>: <why>") and stay readable as
    attributes (a config field that disagrees with the weights or with another component's config)."""

    def __init__(self, message: str, *, file: str | Path | None = None, field: str | None = None) -> None:
        super().__init__(": ".join(str(part) for part in (file, field, message) if part is not None))
        self.file, self.field = (None if file is None else str(file)), field


def resolve_folder(path: str | Path) -> Path:
    """Accept a transformer folder or a pipeline root that holds `transformer/`. A root's `transformer/` wins over
    the root's own config.json: a hub repository's root config.json is the framework's, not the transformer's."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path does not exist: {p}")
    if (p / "transformer" / CONFIG_NAME).is_file():
        return p / "transformer"
    if (p / CONFIG_NAME).is_file() and weight_files(p, required=False):
        return p
    raise CheckpointError(f"{p}: no {CONFIG_NAME} with safetensors weights (nor a transformer/ subfolder)")


def read_json_object(path: Path, what: str, error: type[CheckpointError] = CheckpointError) -> dict[str, Any]:
    """A JSON file that must hold an object (a component's config), or `error` naming the file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"cannot read the {what} ({e.__class__.__name__}: {e})", file=path) from e
    if not isinstance(raw, dict):
        raise error("must be a JSON object", file=path)
    return raw


def read_config(folder: Path) -> Cosmos3Config:
    cfg_path = folder / CONFIG_NAME
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read config ({e})") from e
    try:
        return Cosmos3Config.from_dict(raw)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def read_index(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index: tensor name -> shard path relative to the index's folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable shard index ({e})", file=index) from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("must map tensor names to shard file names", file=index, field="weight_map")
    return weight_map


def weight_files(folder: Path, *, required: bool = True) -> dict[str, Path] | None:
    """Map every checkpoint key to the file holding it: the folder's `*.safetensors.index.json`, else every
    `*.safetensors` file in it."""
    indexes = sorted(folder.glob("*" + INDEX_SUFFIX))
    if indexes:
        return {k: folder / f for k, f in read_index(indexes[0]).items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if required:
            raise CheckpointError(f"{folder}: no .safetensors files")
        return None
    mapping: dict[str, Path] = {}
    for f in files:
        for k in _open(f).keys():
            mapping[k] = f
    return mapping


def _open(file: Path, device: str = "cpu"):  # noqa: ANN202 - safetensors handle type is private
    if not file.is_file():
        raise CheckpointError(f"shard file is missing: {file}")
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e


def _canonical(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key


def _iter_tensors(mapping: dict[str, Path], device: str) -> Iterator[tuple[str, str, Path, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for k, f in mapping.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        handle = _open(f, device)
        present = set(handle.keys())
        for k in keys:
            if k not in present:
                raise CheckpointError(f"{f}: the shard index lists tensor {k!r} but the file lacks it")
            try:
                t = handle.get_tensor(k)
            except Exception as e:
                raise CheckpointError(f"{f}: cannot read tensor {k!r} ({e})") from e
            yield _canonical(k), k, f, t


def _set_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))


def load_transformer(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: Cosmos3Config | None = None,
    weights: Mapping[str, Path] | None = None,
) -> Cosmos3Transformer:
    """Load a diffusers-layout Cosmos 3 transformer folder into our model (eval mode, no grads). `weights`:
    tensor name -> shard file, when another index than the folder's own says where the tensors are."""
    folder = resolve_folder(path)
    cfg = config or read_config(folder)
    mapping = dict(weights) if weights is not None else weight_files(folder)
    assert mapping is not None
    device = torch.device(device)
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
    expected = dict(model.named_parameters())
    seen: set[str] = set()
    # safetensors can only place tensors on cpu/cuda devices by name.
    read_device = str(device) if device.type == "cuda" else "cpu"
    for name, raw_key, file, t in _iter_tensors(mapping, read_device):
        if name in UNUSED_KEYS:
            continue
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {raw_key!r} (not a parameter of this config)")
        if name in seen:
            raise CheckpointError(f"{file}: tensor {raw_key!r} appears twice in the checkpoint")
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{file}: tensor {raw_key!r} has shape {list(t.shape)}, expected {list(want.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {raw_key!r} has dtype {t.dtype}, expected a float type")
        target = torch.float32 if name.startswith(FP32_PREFIXES) else dtype
        _set_param(model, name, t.to(device=device, dtype=target))
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise CheckpointError(f"{folder}: missing tensors: {shown}")
    return model.eval().requires_grad_(False)


def split_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    return shards


def save_transformer(
    model: Cosmos3Transformer, folder: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """Write config.json + safetensors (sharded with an index when max_shard_bytes is given)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"_class_name": "Cosmos3OmniTransformer", "_diffusers_version": "0.42.1", **model.config.to_dict()}
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out
    shards = split_shards(state, max_shard_bytes)
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / (WEIGHTS_NAME + ".index.json")).write_text(json.dumps(index, indent=2) + "\n")
    return out


def init_random_(model: Cosmos3Transformer, seed: int = 0) -> Cosmos3Transformer:
    """Fill every parameter from one seeded stream (random weights at any size, for tests and timing).

    Norm weights 1 + 0.1 N, biases and modality embeddings 0.1 N, matrices N / sqrt(fan_in)
    (per-domain action matrices use the per-domain fan-in), token embeddings N.
    """
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Draw on the parameter's device: filling billions of values on the host would take minutes.
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.copy_(random_value(model, name, p.shape, gen, p.device).to(p.dtype))
    return model


def random_value(model: torch.nn.Module, name: str, shape: torch.Size | tuple[int, ...], gen: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    """The float32 value `init_random_` gives parameter `name` of `model`."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    owner = name.split(".")[-2] if "." in name else ""
    if "norm" in owner:
        return 1.0 + 0.1 * noise
    if len(shape) == 1 or name.endswith("bias.weight"):
        return 0.1 * noise
    if name == "embed_tokens.weight":
        return noise
    if name.endswith("fc.weight"):  # [domains, in*out]
        mod = model.get_submodule(name.rsplit(".", 2)[0])
        return noise / math.sqrt(mod.in_features)
    return noise / math.sqrt(shape[-1])
