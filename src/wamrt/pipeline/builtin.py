"""The embedded default model: a tiny Cosmos-3-architecture policy folder built from code.

It needs no download: the transformer and VAE are seeded random weights in the real layouts, and the
tokenizer is a byte-level BPE with no merges plus the ChatML template and the special tokens the
request path uses. It exercises every stage of the real request path at a size a laptop CPU runs in
well under a second.

`tiny-world` is the same size with sound heads and a tiny sound tokenizer (`sound_tokenizer/`, 16 kHz
stereo, 25 latent frames per second like the released one), so world generation with sound runs end
to end on a CPU; its DROID contract uses the 256 tier, which keeps a CPU policy request near 0.1 s.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

from ..model import Cosmos3Transformer, get_config, init_random_, save_transformer

BUILTIN_MODELS = ("tiny-droid", "tiny-droid-edge", "tiny-world")
_FORMAT_VERSION = 2  # bump when the builder changes, so cached folders are rebuilt

# Tiny Wan2.2-layout VAE (48 latent channels, x16 spatial / x4 temporal) with the real latent stats.
TINY_VAE = dict(
    base_dim=8, decoder_base_dim=4, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4,
)
# Tiny diffusers Cosmos3AVAEAudioTokenizer decoder: 16 kHz (an AAC rate), hop 4 * 8 * 20 = 640 samples = the
# released 25 latent frames per second, stereo like the released one.
TINY_SOUND = dict(sampling_rate=16000, vocoder_input_dim=8, dec_dim=8, dec_c_mults=[1, 2, 4], dec_strides=[4, 8, 20],
                  dec_out_channels=2, encoder_enabled=False)
SPECIAL_TOKENS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2 convention)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    out = {}
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tokenizer(folder: Path, level: str = "bytes") -> None:
    """A Hugging Face tokenizer folder with the ChatML template and the request path's special tokens.
    `bytes`: byte-level BPE without merges (one token per byte; every text round-trips). `words`: one token per
    word or punctuation run, all mapped to one unknown id -- about the token count a BPE vocabulary gives
    English, for timing runs on random weights, where ids do not matter but sequence lengths do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if level == "bytes":
        vocab = {sym: i for i, sym in enumerate(_byte_level_alphabet())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    elif level == "words":
        tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        raise ValueError(f"level must be 'bytes' or 'words', got {level!r}")
    tok.add_special_tokens(SPECIAL_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                      "<|video_pad|>"],
        "chat_template": CHAT_TEMPLATE, "model_max_length": 32768,
    }, indent=2))


def write_vae(folder: Path, seed: int) -> None:
    from .vae import WAN22_LATENT_MEAN, WAN22_LATENT_STD

    cfg = dict(TINY_VAE, latents_mean=list(WAN22_LATENT_MEAN), latents_std=list(WAN22_LATENT_STD))
    vae = AutoencoderKLWan(**cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.05 * noise)
            else:
                p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", **cfg}, indent=2))
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))


def random_sound_tokenizer(config: dict, seed: int):
    """A `Cosmos3AVAEAudioTokenizer` of `config` with seeded random weights at scales that keep its decoder's
    output in range (the Snake parameters are log-scale, weight-normed convolutions get unit-ish norms)."""
    from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

    tok = Cosmos3AVAEAudioTokenizer(**config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tok.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("alpha", "beta")):
                p.copy_(0.2 * noise)
            elif name.endswith("weight_g"):
                p.copy_(0.7 + 0.05 * noise)
            elif name.endswith("weight_v"):
                p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.05 * noise)
    return tok


def write_sound_tokenizer(folder: Path, seed: int) -> None:
    """A decoder-only `Cosmos3AVAEAudioTokenizer` (TINY_SOUND) with seeded random weights, diffusers layout."""
    tok = random_sound_tokenizer(TINY_SOUND, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "Cosmos3AVAEAudioTokenizer", **TINY_SOUND},
                                                   indent=2))
    save_file({k: v.contiguous() for k, v in tok.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))


def build_builtin(name: str, folder: Path) -> Path:
    """Write the named embedded model into `folder` (transformer/ with the Reasoner's lm_head, vae/, tokenizer/,
    wamrt.json; tiny-world also sound_tokenizer/ and a Qwen3-VL vision tower in the hub layout: vision_encoder/ and a
    root model.safetensors.index.json over transformer/ and vision_encoder/)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {BUILTIN_MODELS}")
    edge, world = name.endswith("edge"), name == "tiny-world"
    cfg = get_config("tiny-edge" if edge else "tiny-qwen").replace(vocab_size=512)
    seed = 2026 + edge
    if world:
        cfg, seed = cfg.replace(sound_gen=True, sound_dim=TINY_SOUND["vocoder_input_dim"]), 2030
        write_sound_tokenizer(folder / "sound_tokenizer", seed + 2)
    save_transformer(init_random_(Cosmos3Transformer(cfg), seed), folder / "transformer")
    from ..reasoner.builtin import add_lm_head, add_vision_encoder

    add_lm_head(folder / "transformer", seed + 3)
    if world:
        add_vision_encoder(folder, cfg.hidden_size, seed + 4)
    write_vae(folder / "vae", seed + 1)
    write_tokenizer(folder / "tokenizer")
    policy = {"format_version": _FORMAT_VERSION, "contract": "droid", "prompt_format": "json" if edge else "plain",
              "guidance_interval": [960, 1001] if edge else None, "weights": f"random (seed {seed})"}
    if world:
        policy["tier"] = "256"
    (folder / "wamrt.json").write_text(json.dumps(policy, indent=2) + "\n")
    return folder


def builtin_path(name: str) -> Path:
    """The cached folder of a built-in model, built on first use (atomically, so concurrent first
    uses cannot see a half-written folder)."""
    root = Path(os.environ.get("WAMRT_CACHE", Path.home() / ".cache" / "wamrt")) / "builtin"
    folder = root / name
    marker = folder / "wamrt.json"
    if marker.is_file() and json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION:
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.{os.getpid()}.tmp"
    build_builtin(name, tmp)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
