"""`load_policy`: a checkpoint folder (or a built-in name) -> a `Policy` that turns observations into
action chunks through the eager reference path; `random_policy`: one with random weights at a registered size."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Unpack

import numpy as np
import torch

from ..model import Cosmos3Transformer, get_config, load_transformer
from ..model.checkpoint import CheckpointError, read_config, read_json_object
from .builtin import BUILTIN_MODELS, builtin_path
from .denoise import SamplingOptions, SamplingOverrides, check_option_names
from .droid import ActionChunk, DroidContract, PromptFormat, droid_metadata, run_droid
from .errors import RequestError
from .generic import GenericResult, run_generic
from .geometry import FRAMEWORK_VIDEO_RES_SIZE_INFO
from .layout import POLICY_CONFIG, CheckpointLayout, check_components, resolve_layout, scheduler_defaults
from .normalization import KEY as NORM_KEY
from .normalization import ActionNormalization
from .prefix import TRAINED_KEY
from .random_weights import random_quantized_transformer, random_tokenizer, random_transformer, random_vae
from .tokens import CaptionTokenizer
from .vae import FrameEncoder, load_vae, read_vae_config

log = logging.getLogger(__name__)


class Policy:
    """A loaded Cosmos 3 policy (`load_policy`). `infer` runs the DROID contract on one observation; `options`
    are its sampling defaults; `layout` says which files it was loaded from (None for random weights)."""

    def __init__(
        self,
        model: Cosmos3Transformer,
        encoder: FrameEncoder,
        tokenizer: CaptionTokenizer,
        contract: DroidContract,
        options: SamplingOptions,
        *,
        name: str = "",
        quantization: str | None = None,
        layout: CheckpointLayout | None = None,
    ) -> None:
        self.model, self.encoder, self.tokenizer = model, encoder, tokenizer
        self.layout = layout
        self.contract, self.options, self.name = contract, options, name
        self.quantization = quantization  # the `wamrt quantize` recipe the weights were loaded from, if any
        # The framework server's seed stream: one draw per request from default_rng(0).
        self._seeds = np.random.default_rng(0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def next_seed(self) -> int:
        return int(self._seeds.integers(0, 2**31))

    def infer(self, observation: Mapping[str, Any], *, seed: int | None = None,
              **overrides: Unpack[SamplingOverrides]) -> ActionChunk:
        """One DROID observation -> an `ActionChunk` of [32, 8] float32 (7 joint targets in radians, gripper).

        observation: the openpi DROID keys (`wamrt.pipeline.observation` lists them, with the optional ones and
            their defaults, `action_prefix` [d, 8] and `action_prefix_mode` among them: `wamrt.pipeline.prefix`;
            the server accepts the same dict). A bad one raises RequestError naming the key.
        seed: the noise seed (default: the next of the server's stream, `default_rng(0)`).
        overrides: `SamplingOptions` fields for this call only (steps, guidance, shift, guidance_interval, ...);
            an unknown name raises UnknownOptionError with "did you mean".
        """
        opts = self.options.updated(**overrides)
        validate_options(opts)
        chunk, _, _ = run_droid(observation, model=self.model, encoder=self.encoder, tokenizer=self.tokenizer,
                                contract=self.contract, options=opts,
                                seed=self.next_seed() if seed is None else seed)
        if not np.isfinite(chunk.actions).all():
            raise FloatingPointError("the model produced non-finite actions")
        return chunk

    def generic(self, mode: str, **request: Any) -> GenericResult:
        """Any task as diffusers 0.42.1 defines it (see `wamrt.pipeline.generic.run_generic` for the
        arguments: prompt, domain, chunk_size, image/video, raw_actions, resolution_tier, ...)."""
        with torch.inference_mode():
            return run_generic(self.model, self.encoder, self.tokenizer, mode=mode, **request)

    def forward_dynamics(self, image: Any, raw_actions: Any, *, prompt: str, domain: str, **request: Any
                         ) -> GenericResult:
        """image + actions -> future video latents (`decode=True` also returns uint8 frames)."""
        return self.generic("forward_dynamics", image=image, raw_actions=raw_actions, prompt=prompt,
                            domain=domain, chunk_size=request.pop("chunk_size", len(raw_actions)), **request)

    def inverse_dynamics(self, video: Any, *, prompt: str, domain: str, **request: Any) -> GenericResult:
        """video (chunk + 1 frames) -> the actions between them, [chunk, raw width]."""
        return self.generic("inverse_dynamics", video=video, prompt=prompt, domain=domain,
                            chunk_size=request.pop("chunk_size", len(video) - 1), **request)

    def infer_batch(
        self, observations: list[Mapping[str, Any]], *, seeds: list[int | None] | None = None,
        **overrides: Unpack[SamplingOverrides],
    ) -> list[ActionChunk | Exception]:
        """Several requests of one shape bucket. A bad request yields its exception in its slot and
        never fails the others. (Eager reference: one after another; the engine batches them.)"""
        check_option_names(overrides)
        seeds = seeds or [None] * len(observations)
        out: list[ActionChunk | Exception] = []
        for obs, seed in zip(observations, seeds, strict=True):
            try:
                out.append(self.infer(obs, seed=seed, **overrides))
            except (RequestError, FloatingPointError) as e:
                out.append(e)
        return out

    def metadata(self) -> dict[str, Any]:
        return {**droid_metadata(self.name, self.contract, self.options), "quantization": self.quantization,
                "gpu": device_name(self.device)}

    def __repr__(self) -> str:
        c = self.model.config
        return (f"Policy({self.name!r}, {c.num_hidden_layers} layers x {c.hidden_size}, {c.hidden_act}, "
                f"{self.model.dtype}, {self.device}, prompt={self.contract.prompt_format})")


def device_name(device: torch.device) -> str:
    """The GPU's name (what a result file records), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def contract_from_config(extra: Mapping[str, Any], *, prompt_format: str | None = None,
                         source: str = POLICY_CONFIG) -> DroidContract:
    """The DROID contract a checkpoint's wamrt.json asks for (prompt format, tier, normalization, whether it was
    trained with action prefixes)."""
    fmt = prompt_format or extra.get("prompt_format", "plain")
    if fmt not in ("plain", "json"):
        raise RequestError(f"must be 'plain' or 'json', got {fmt!r}", field="prompt_format")
    tier = str(extra.get("tier", DroidContract.tier))  # a small trained policy may use a smaller bucket tier
    if tier not in FRAMEWORK_VIDEO_RES_SIZE_INFO:
        raise RequestError(f"unknown resolution tier {tier!r} in {POLICY_CONFIG}", field="tier")
    norm = extra.get(NORM_KEY)
    base = DroidContract()
    normalization = (ActionNormalization.from_json(norm, raw_dim=base.raw_action_dim, chunk=base.chunk, source=source)
                     if norm is not None else None)
    trained = extra.get(TRAINED_KEY, False)
    if not isinstance(trained, bool):
        raise RequestError(f"must be true or false in {POLICY_CONFIG}, got {trained!r}", field=TRAINED_KEY)
    return DroidContract(prompt_format=fmt, tier=tier, normalization=normalization,  # type: ignore[arg-type]
                         trained_with_action_prefix=trained)


def validate_options(opts: SamplingOptions) -> None:
    if not isinstance(opts.steps, int) or not 1 <= opts.steps <= 1000:
        raise RequestError(f"must be an integer in [1, 1000], got {opts.steps!r}", field="steps")
    if not np.isfinite(opts.guidance) or opts.guidance < 0:
        raise RequestError(f"must be a finite number >= 0, got {opts.guidance!r}", field="guidance")
    if not np.isfinite(opts.shift) or opts.shift <= 0:
        raise RequestError(f"must be a finite number > 0, got {opts.shift!r}", field="shift")
    gi = opts.guidance_interval
    if gi is not None and (len(gi) != 2 or gi[0] >= gi[1]):
        raise RequestError(f"must be [lo, hi] with lo < hi, got {gi!r}", field="guidance_interval")


# Policies trained in-repo (`wamrt train`, scripts/gpu_pipeline.sh) and committed as package data. An
# environment variable WAMRT_<NAME> (e.g. WAMRT_PANDA_DROID) points a name at another folder (tests).
# panda-droid-rt: panda-droid continued with random clean action prefixes (gpu_run.sh prefix-train; docs/prefix.md).
TRAINED_MODELS = {name: Path(__file__).resolve().parents[1] / "assets" / name
                  for name in ("panda-droid", "panda-droid-rt")}


def trained_path(name: str) -> Path:
    override = os.environ.get("WAMRT_" + name.upper().replace("-", "_"))
    folder = Path(override) if override else TRAINED_MODELS[name]
    if not (folder / POLICY_CONFIG).is_file():
        how = ("scripts/gpu_run.sh prefix-train and unpack its prefix-ckpt.tgz there" if name == "panda-droid-rt" else
               "scripts/gpu_pipeline.sh and unpack its checkpoint-<variant>.tgz there")
        raise RequestError(f"the trained model {name!r} is not present at {folder} (train it with {how})",
                           field="model")
    return folder


def checkpoint_root(name: str | Path) -> Path:
    """The folder a model name stands for: a built-in (built on first use), a trained model, or the path itself."""
    name = str(name)
    if name in BUILTIN_MODELS:
        return builtin_path(name)
    return trained_path(name) if name in TRAINED_MODELS else Path(name)


def read_policy_config(layout: CheckpointLayout) -> dict[str, Any]:
    """The checkpoint's wamrt.json (contract options), {} when it has none."""
    if layout.policy_config is None:
        return {}
    return read_json_object(layout.policy_config, "contract options")


def load_policy(
    path_or_name: str | Path = "tiny-droid",
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    vae: str | Path | None = None,
    prompt_format: PromptFormat | None = None,
    options: SamplingOptions | None = None,
    transformer_loader: Callable[[CheckpointLayout, torch.device, torch.dtype], Any] | None = None,
) -> Policy:
    """Load a policy (transformer + VAE + tokenizer) from a checkpoint folder or a built-in name.

    path_or_name: a folder in any layout `wamrt.pipeline.layout` reads (a diffusers `save_pretrained` pipeline, a
        hub repository with a root weight index, wamrt's own, a bare transformer folder, a `wamrt quantize`
        artifact); a built-in name (`tiny-droid`, `tiny-droid-edge`, `tiny-world`: no download); a trained model
        (`panda-droid`); or `random:SIZE` (random weights at a registered size, e.g. `random:nano`, for load tests;
        its stand-in tokenizer's token count follows the text: `random_weights.VariableLengthTokenizer`).
    device: "cuda" / "cpu" / a torch.device (default: CUDA when available).
    dtype: default bf16 on CUDA, fp32 on CPU; the VAE runs in the same dtype.
    tokenizer, vae: folders that replace the checkpoint's own (`--tokenizer` / `--vae` on the command line).
    prompt_format: "plain" or "json" captions (default: the checkpoint's wamrt.json, else plain).
    options: sampling defaults (default: the DROID server's, with the shift of the checkpoint's scheduler config
        when it sets one: `layout.scheduler_defaults`).
    transformer_loader: builds the transformer from the resolved layout instead of reading it whole (a
        tensor-parallel rank reads its slices: `wamrt.parallel.launch`); everything else loads as it does here.

    A folder whose parts disagree (VAE statistics vs z_dim, latent channels, vocabulary, action width, domain
    count, tensor shapes) raises CheckpointError, one line naming the file and the field.
    """
    name = str(path_or_name)
    if name.startswith("random:"):
        # Random weights at a registered size (edge, nano, super, tiny-*): for load tests and serving, with
        # a stand-in tokenizer whose token count follows the text, so lanes with different instructions
        # send different prefix lengths (`wamrt bench latency` builds its own, fixed-length, workload).
        # random:SIZE@RECIPE: quantized by a `wamrt quantize` recipe, built quantized (never the bf16 model first)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        size, _, recipe = name.split(":", 1)[1].partition("@")
        return random_policy(size, dev, dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32),
                             tiny_vae=size.startswith("tiny"), tokenizer="variable", recipe=recipe or None)
    root = checkpoint_root(name)
    if not root.exists():
        raise RequestError(f"no checkpoint at {root} (built-in models: {', '.join(BUILTIN_MODELS)})",
                           field="model")
    layout = resolve_layout(root, tokenizer=tokenizer, vae=vae)
    tok_dir, vae_dir = layout.require_tokenizer(), layout.require_vae()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    extra = read_policy_config(layout)
    contract = contract_from_config(extra, prompt_format=prompt_format,
                                    source=str(layout.policy_config or root / POLICY_CONFIG))
    try:
        tok = CaptionTokenizer.from_pretrained(tok_dir)
    except (RequestError, OSError, ValueError) as e:  # a folder transformers cannot read, or one without our tokens
        raise CheckpointError(str(e).removeprefix("tokenizer: "), file=tok_dir) from e
    # Every config that must agree is checked before any weight is read: a mismatch is one line, not a
    # shape error deep in a layer.
    check_components(layout, read_config(layout.transformer), vae_z_dim=read_vae_config(vae_dir)["z_dim"],
                     max_token_id=max(tok.encode("").text_ids), action_columns=contract.raw_action_dim,
                     domain_id=contract.domain_id)
    quantization: str | None = None
    if layout.quantized is not None:
        from ..quant import load_artifact  # a `wamrt quantize` artifact: hashes verified before loading

        model = load_artifact(layout.quantized, dev, dt)
        quantization = json.loads((layout.quantized / "recipe.json").read_text()).get("recipe", {}).get("name")
    elif transformer_loader is not None:
        model = transformer_loader(layout, dev, dt)
    else:
        model = load_transformer(layout.transformer, device=dev, dtype=dt, weights=layout.transformer_weights())
    encoder = FrameEncoder(load_vae(vae_dir, device=dev, dtype=dt))
    if options is None:
        gi = extra.get("guidance_interval")
        defaults = scheduler_defaults(layout)
        for note in defaults.notes:
            log.warning(note)
        options = SamplingOptions(guidance_interval=tuple(gi) if gi else None,
                                  **({"shift": defaults.shift} if defaults.shift is not None else {}))
    return Policy(model, encoder, tok, contract, options, name=name, quantization=quantization, layout=layout)


def random_policy(size: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, *,
                  layers: int | None = None, tiny_vae: bool = False, prompt_format: str = "plain",
                  tokenizer: str = "fixed", recipe: str | None = None) -> Policy:
    """`tokenizer`: "fixed" (performance.md's 125 / 30 tokens whatever the text; `wamrt bench latency`) or
    "variable" (the count follows the text; `wamrt serve --model random:SIZE`). `recipe`: the weights quantized by
    that `wamrt quantize` recipe (built quantized, `random_quantized_transformer`)."""
    dev = torch.device(device)
    tok = random_tokenizer(tokenizer, get_config(size).vocab_size)  # checked before the (large) build
    if recipe is not None:
        if layers is not None:
            raise ValueError("layers and recipe together are not supported")
        model = random_quantized_transformer(size, dev, dtype, recipe)
    else:
        model = random_transformer(size, dev, dtype, layers=layers)
    encoder = FrameEncoder(random_vae(dev, dtype, tiny=tiny_vae))
    return Policy(model, encoder, tok, DroidContract(prompt_format=prompt_format),  # type: ignore[arg-type]
                  SamplingOptions(), name=f"{size} (random weights{', ' + recipe if recipe else ''})",
                  quantization=recipe)
