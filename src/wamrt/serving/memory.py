"""`wamrt serve`'s memory plan, made before the weights load: the model's sizes from its safetensors headers (or,
for `random:SIZE[@RECIPE]`, from its config on the meta device), the device's memory or `--gpu-memory`, and
`engine.memory_plan.plan_serving`. Below the device's memory the allocator is capped there, as on a smaller card."""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

from ..engine.memory_plan import GIB, MemoryPlan, ModelMemory, ServingMemory, plan_serving
from .config import ServeConfig

log = logging.getLogger("wamrt.serving")

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP32_KEPT = ("time_embedder.",)  # model.checkpoint.FP32_PREFIXES: kept in float32 whatever the model dtype
HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not one


def loaded_itemsize(name: str, itemsize: int, floating: bool, dtype_bytes: int) -> int:
    """Bytes per element of tensor `name` once loaded in a `dtype_bytes` model dtype: floating tensors are cast to
    it, except the float32 ones the loaders keep (the time embedder, quantization scales); 8-bit and integer
    tensors stay as they are."""
    name = name.removeprefix("model.")
    if not floating or itemsize == 1 or name.startswith(FP32_KEPT) or "scale" in name.rsplit(".", 1)[-1]:
        return itemsize
    return dtype_bytes


def safetensors_bytes(files: list[Path], *, dtype_bytes: int = 2) -> int:
    """Bytes the tensors of `files` take once loaded (`loaded_itemsize`), from their headers alone."""
    return sum(tensor_bytes(files, dtype_bytes=dtype_bytes).values())


def tensor_bytes(files: list[Path], *, dtype_bytes: int = 2) -> dict[str, int]:
    """Each tensor's bytes once loaded (`loaded_itemsize`), by key, from the files' headers alone."""
    out: dict[str, int] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if not 0 < n <= HEADER_LIMIT:
                raise ValueError(f"{f}: not a safetensors file (header of {n} bytes)")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            size = DTYPE_BYTES.get(info["dtype"], 4)
            out[name] = math.prod(info["shape"]) * loaded_itemsize(name, size, info["dtype"] in FLOAT_DTYPES,
                                                                   dtype_bytes)
    return out


def _weight_files(folder: Path) -> list[Path]:
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        names = set(json.loads(index[0].read_text())["weight_map"].values())
        return [folder / n for n in sorted(names)]
    return sorted(folder.glob("*.safetensors"))


def _meta_bytes(module: Any, dtype_bytes: int) -> int:
    """A model built (in float32) on the meta device, as it would be loaded (`loaded_itemsize`)."""
    return sum(t.numel() * loaded_itemsize(name, t.element_size(), t.dtype.is_floating_point, dtype_bytes)
               for name, t in [*module.named_parameters(), *module.named_buffers()])


def random_model_memory(spec: str) -> ModelMemory:
    """`random:SIZE` or `random:SIZE@RECIPE` (its weights quantized by a `wamrt quantize` recipe)."""
    import torch

    from ..model import Cosmos3Transformer, get_config
    from ..pipeline.random_weights import WAN22_VAE

    size, _, recipe = spec.removeprefix("random:").partition("@")
    cfg = get_config(size)
    with torch.device("meta"):
        model = Cosmos3Transformer(cfg)
        if recipe:
            from ..quant import quantize_model

            quantize_model(model, recipe)
        from diffusers import AutoencoderKLWan

        from ..pipeline.builtin import TINY_VAE

        vae = AutoencoderKLWan(**(TINY_VAE if size.startswith("tiny") else WAN22_VAE))
    return ModelMemory(cfg, _meta_bytes(model, 2), _meta_bytes(vae, 2), recipe or None)


def checkpoint_memory(root: Path, *, tokenizer: str | None = None, vae: str | None = None) -> ModelMemory:
    """A checkpoint folder of any layout `pipeline.layout.resolve_layout` reads (a `wamrt quantize` artifact
    included), from its configs and safetensors headers; `tokenizer` / `vae` as `--tokenizer` / `--vae`."""
    from ..model.checkpoint import read_config
    from ..pipeline.layout import resolve_layout

    layout = resolve_layout(root, tokenizer=tokenizer, vae=vae)
    cfg = read_config(layout.transformer)
    recipe = None
    if layout.quantized is not None:
        recipe = json.loads((layout.quantized / "recipe.json").read_text()).get("recipe", {}).get("name")
        files = _weight_files(layout.quantized)
    else:
        files = sorted(set((layout.transformer_weights() or {}).values()))
    sizes = tensor_bytes(files)
    head = sum(sizes.pop(k) for k in list(sizes) if k.removeprefix("transformer.") in LM_HEAD_KEYS)  # not the engine's
    vae_bytes = safetensors_bytes(_weight_files(layout.vae)) if layout.vae is not None else 0
    chat = 0
    if head and layout.tokenizer is not None and _has_chat_template(layout.tokenizer):
        vision = sorted(set(layout.vision_encoder_weights().values()))
        chat = head + (safetensors_bytes(vision) if vision else 0)
    return ModelMemory(cfg, sum(sizes.values()), vae_bytes, recipe,
                       generation=layout.vae is not None and layout.tokenizer is not None, chat_bytes=chat)


LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")  # reasoner.load.LM_HEAD_KEYS


def _has_chat_template(tokenizer: Path) -> bool:
    """The tokenizer folder carries a chat template (what `reasoner_of` needs to serve chat)."""
    if (tokenizer / "chat_template.jinja").is_file() or (tokenizer / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "chat_template" in config


def model_memory(name: str, *, tokenizer: str | None = None, vae: str | None = None) -> ModelMemory:
    from ..pipeline.policy import checkpoint_root

    if name.startswith("random:"):
        return random_model_memory(name)
    return checkpoint_memory(checkpoint_root(name), tokenizer=tokenizer, vae=vae)


def device_memory(device: str) -> int:
    """The CUDA device's memory in bytes (0 for a CPU device)."""
    if not device.startswith("cuda"):
        return 0
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def serving_memory(config: ServeConfig, *, max_batch: int | None, max_video_pixels: int | None,
                   grouped_buffers: bool) -> ServingMemory:
    """What `config` asks the device to hold. The prefix widths are estimated for a caption template of up to 128
    tokens (DROID captions take 90-120 with the released tokenizers); `startup` re-plans with the real one."""
    bucket = max(config.prompt_bucket, 1)

    def up(n: int) -> int:
        return -(-n // bucket) * bucket

    widths = config.prompt_widths or tuple(sorted({up(128 + 128), up(128 + config.max_prompt_tokens)}))
    # The prefix caches: a GiB unless given (about 30 Nano prompts of 150 tokens, and their padded copies)
    return ServingMemory(max_batch=max_batch, widths=widths, grouped_buffers=grouped_buffers,
                         max_video_pixels=max_video_pixels, prefix_cache_bytes=config.kv_cache_bytes or GIB,
                         chat_rows=config.chat_max_batch, chat_context=config.chat_context)


def make_plan(config: ServeConfig, device: str, *, model: ModelMemory | None = None, max_batch: int | None = None,
              max_video_pixels: int | None = None, tokenizer: str | None = None, vae: str | None = None) -> MemoryPlan:
    """The plan for serving `config.model_name` on `device` (raises `MemoryPlanError`, naming the part)."""
    model = model or model_memory(config.model_name, tokenizer=tokenizer, vae=vae)
    total = device_memory(device)
    capacity = int(config.gpu_memory_gib * GIB) if config.gpu_memory_gib else total
    if not capacity:
        raise ValueError("nothing to plan into: a CPU device and no --gpu-memory")
    serving = serving_memory(config, max_batch=max_batch, max_video_pixels=max_video_pixels,
                             grouped_buffers=config.attention == "fa4")
    return plan_serving(model, serving, capacity=capacity, device_total=total)


def cap_device(plan: MemoryPlan, device: str) -> float | None:
    """Hold the allocator to the plan's capacity when it is below the device's memory; returns the cap in GiB."""
    if not (plan.capped and device.startswith("cuda")):
        return None
    import torch

    # The allocator's cap is per device index, and it refuses a bare "cuda" (the default `--device`).
    index = torch.device(device).index
    torch.cuda.set_per_process_memory_fraction(plan.capacity / plan.device_total,
                                               torch.cuda.current_device() if index is None else index)
    return plan.capacity / GIB
