"""The Cosmos 3 Mixture-of-Transformers (Reasoner + Generator) as plain nn.Modules.

Batched layout: every tensor has a leading batch dim B. A Generator sequence is
[vision patches | sound frames | action rows], or for video transfer [control_1 | ... | control_N | vision]
(each control a clean video on the target's own (t, h, w) grid); its Reasoner prefix is text only. Sequences of one
batch share the Generator geometry; their Reasoner prefixes may differ in length (padded, with a
key mask), which is how the two classifier-free-guidance branches run as one batch.

Two ways to run it, numerically identical:
* `forward` interleaves both streams layer by layer, like the reference implementation;
* `prefill_reasoner` once per prompt -> `ReasonerKV`, then `run_generator` per denoising step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionFn, ControlSegments, sdpa_attention
from .config import Cosmos3Config
from .embeddings import DomainLinear, TimestepMLP, patchify, timestep_features, unpatchify
from .layer import MoTLayer
from .norms import RMSNorm
from .rope import Rope, mrope_tables


@dataclass
class ReasonerKV:
    """Per-layer Reasoner keys (as Generator queries see them: after norm, extra Edge norm and RoPE)
    and values, each [B, K, U, d]. `key_mask` [B, U] marks real (non-padding) tokens, or None."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@dataclass
class GeneratorTokens:
    """Noisy/clean latents of one denoising step. Masks say which frames/rows are noisy (denoised,
    given a time embedding, velocity predicted); clean ones are conditioning."""

    timesteps: torch.Tensor  # [B] scheduler timestep (e.g. 999.), scaled by timestep_scale inside
    vision: torch.Tensor | None = None  # [B, C, T, H, W]
    vision_noisy: torch.Tensor | None = None  # [B, T] bool
    sound: torch.Tensor | None = None  # [B, S, Ts]
    sound_noisy: torch.Tensor | None = None  # [B, Ts] bool
    action: torch.Tensor | None = None  # [B, Ta, A] (zero-padded to action_dim)
    action_noisy: torch.Tensor | None = None  # [B, Ta] bool
    domain_ids: torch.Tensor | None = None  # [B] long
    # Video transfer: N clean control videos [B, N, C, T, H, W] (vision's shape), packed before the vision tokens:
    # no time embedding, no velocity; and each control's weight in the target's attention, [B, N] summing to 1.
    controls: torch.Tensor | None = None
    control_weights: torch.Tensor | None = None

    def control_segments(self, patch: int) -> ControlSegments | None:
        return ControlSegments.of(self.controls, self.control_weights, patch)

    def control_tokens(self, patch: int) -> int:
        """Tokens of the controls in front of the vision tokens (0 without controls)."""
        seg = self.control_segments(patch)
        return 0 if seg is None else seg.count * seg.tokens

    def counts(self, patch: int) -> tuple[int, int, int]:
        """Number of (vision, sound, action) tokens (the controls in front of them not counted)."""
        nv = 0
        if self.vision is not None:
            _, _, t, h, w = self.vision.shape
            nv = t * (-(-h // patch)) * (-(-w // patch))
        ns = self.sound.shape[2] if self.sound is not None else 0
        na = self.action.shape[1] if self.action is not None else 0
        return nv, ns, na


@dataclass
class GeneratorOutput:
    """Velocities, zero on clean frames/rows: vision [B, C, T, H, W], sound [B, S, Ts], action [B, Ta, A]."""

    vision: torch.Tensor | None
    sound: torch.Tensor | None
    action: torch.Tensor | None


class Cosmos3Transformer(nn.Module):
    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        self.config = cfg
        h, nem = cfg.hidden_size, cfg.nemotron_norm
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(MoTLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, nemotron=nem)  # Reasoner final norm: its output is unused
        self.norm_moe_gen = RMSNorm(h, cfg.rms_norm_eps, nemotron=nem)
        self.proj_in = nn.Linear(cfg.patch_latent_dim, h)
        self.proj_out = nn.Linear(h, cfg.patch_latent_dim)
        self.time_embedder = TimestepMLP(cfg.time_proj_dim, h)
        if cfg.action_gen:
            assert cfg.action_dim is not None
            self.action_proj_in = DomainLinear(cfg.action_dim, h, cfg.num_embodiment_domains)
            self.action_proj_out = DomainLinear(h, cfg.action_dim, cfg.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(h))
        if cfg.sound_gen:
            assert cfg.sound_dim is not None
            self.audio_proj_in = nn.Linear(cfg.sound_dim, h)
            self.audio_proj_out = nn.Linear(h, cfg.sound_dim)
            self.audio_modality_embed = nn.Parameter(torch.zeros(h))
        # Swappable from outside (engine): same contract as `sdpa_attention`.
        self.attention: AttentionFn = sdpa_attention

    # ---------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    def rope(self, positions: torch.Tensor) -> Rope:
        """positions [B, 3, N] float32 -> cos/sin tables in the model dtype."""
        c = self.config
        return mrope_tables(positions, head_dim=c.head_dim, theta=c.rope_theta, axes=c.rope_axes_dim,
                            dtype=self.dtype)

    def time_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps [B] -> [B, h] in the model dtype; the MLP runs once per sequence, in fp32."""
        feats = timestep_features(timesteps.float() * self.config.timestep_scale, self.config.time_proj_dim)
        mlp_dtype = self.time_embedder.linear_1.weight.dtype
        return self.time_embedder(feats.to(mlp_dtype)).to(self.dtype)

    # Reasoner ------------------------------------------------------------------------------------
    def prefill_reasoner(self, input_ids: torch.Tensor, rope: Rope) -> ReasonerKV:
        """input_ids [B, U] -> per-layer K/V. Its result is fixed for a prompt: compute it once."""
        u: torch.Tensor | None = self.embed_tokens(input_ids)
        keys, values = [], []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            assert u is not None
            u, k, v = layer.reasoner(u, rope, self.attention, need_output=i < last)
            keys.append(k)
            values.append(v)
        return ReasonerKV(keys, values)

    # Generator -----------------------------------------------------------------------------------
    def _check_domains(self, domain_ids: torch.Tensor) -> None:
        # Only on CPU: on an accelerator the check would be a host sync inside the denoising loop.
        if domain_ids.device.type == "cpu":
            n = self.config.num_embodiment_domains
            if bool(((domain_ids < 0) | (domain_ids >= n)).any()):
                raise ValueError(f"action domain ids must be in [0, {n}), got {domain_ids.tolist()}")

    def embed_generator(self, tok: GeneratorTokens) -> torch.Tensor:
        """Latents -> Generator hidden states [B, G, h]; time embedding added to noisy tokens only."""
        c, dt = self.config, self.dtype
        temb = self.time_embedding(tok.timesteps)[:, None, :]  # [B, 1, h]
        parts = []
        if tok.controls is not None:  # clean, so no time embedding; the same projection as the target
            if tok.vision is None or tok.controls.shape[:1] + tok.controls.shape[2:] != tok.vision.shape:
                raise ValueError("controls must be [B, N, *vision's C, T, H, W]")
            b, n = tok.controls.shape[:2]
            x = self.proj_in(patchify(tok.controls.flatten(0, 1).to(dt), c.latent_patch_size))  # [B*N, Nv, h]
            parts.append(x.unflatten(0, (b, n)).flatten(1, 2))  # [B, N*Nv, h]
        if tok.vision is not None:
            assert tok.vision_noisy is not None
            _, _, t, hl, wl = tok.vision.shape
            x = self.proj_in(patchify(tok.vision.to(dt), c.latent_patch_size))  # [B, Nv, h]
            per_frame = x.shape[1] // t
            noisy = tok.vision_noisy.repeat_interleave(per_frame, dim=1)[..., None]
            parts.append(torch.where(noisy, x + temb, x))
        if tok.sound is not None:
            assert tok.sound_noisy is not None
            x = self.audio_proj_in(tok.sound.to(dt).transpose(1, 2)) + self.audio_modality_embed
            parts.append(torch.where(tok.sound_noisy[..., None], x + temb, x))
        if tok.action is not None:
            assert tok.action_noisy is not None and tok.domain_ids is not None
            self._check_domains(tok.domain_ids)
            x = self.action_proj_in(tok.action.to(dt), tok.domain_ids) + self.action_modality_embed
            parts.append(torch.where(tok.action_noisy[..., None], x + temb, x))
        if not parts:
            raise ValueError("a Generator sequence needs at least one of vision, sound, action")
        return torch.cat(parts, dim=1)

    def run_generator(self, g: torch.Tensor, rope: Rope, kv: ReasonerKV,
                      controls: ControlSegments | None = None) -> torch.Tensor:
        """g [B, G, h] through every layer against cached Reasoner K/V -> final-normed [B, G, h]."""
        for layer, k, v in zip(self.layers, kv.keys, kv.values, strict=True):
            g = layer.generator(g, rope, k, v, self.attention, kv.key_mask, controls)
        return self.norm_moe_gen(g)

    def decode_generator(self, g: torch.Tensor, tok: GeneratorTokens) -> GeneratorOutput:
        """Final Generator hidden states -> velocities, exactly zero on clean frames/rows (controls have none)."""
        c = self.config
        g = g[:, tok.control_tokens(c.latent_patch_size):]
        nv, ns, na = tok.counts(c.latent_patch_size)
        vision = sound = action = None
        if tok.vision is not None:
            assert tok.vision_noisy is not None
            _, _, t, hl, wl = tok.vision.shape
            v = unpatchify(self.proj_out(g[:, :nv]), t, hl, wl, c.latent_patch_size)  # [B, C, T, H, W]
            vision = torch.where(tok.vision_noisy[:, None, :, None, None], v, torch.zeros_like(v))
        if tok.sound is not None:
            assert tok.sound_noisy is not None
            s = self.audio_proj_out(g[:, nv : nv + ns]).transpose(1, 2)  # [B, S, Ts]
            sound = torch.where(tok.sound_noisy[:, None, :], s, torch.zeros_like(s))
        if tok.action is not None:
            assert tok.action_noisy is not None and tok.domain_ids is not None
            a = self.action_proj_out(g[:, nv + ns : nv + ns + na], tok.domain_ids)  # [B, Ta, A]
            action = torch.where(tok.action_noisy[..., None], a, torch.zeros_like(a))
        return GeneratorOutput(vision, sound, action)

    def generator_step(self, tok: GeneratorTokens, rope: Rope, kv: ReasonerKV) -> GeneratorOutput:
        """One Generator pass (one denoising step) against cached Reasoner K/V."""
        g = self.run_generator(self.embed_generator(tok), rope, kv, tok.control_segments(self.config.latent_patch_size))
        return self.decode_generator(g, tok)

    # Full forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, tok: GeneratorTokens) -> GeneratorOutput:
        """Both streams layer by layer. input_ids [B, U]; positions [B, 3, U + G] for the packed
        sequence [text | controls | vision | sound | action]."""
        und_len = input_ids.shape[1]
        controls = tok.control_segments(self.config.latent_patch_size)
        rope_und, rope_gen = self.rope(positions).split(und_len)
        u: torch.Tensor | None = self.embed_tokens(input_ids)
        g = self.embed_generator(tok)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            assert u is not None
            u, k, v = layer.reasoner(u, rope_und, self.attention, need_output=i < last)
            g = layer.generator(g, rope_gen, k, v, self.attention, controls=controls)
        return self.decode_generator(self.norm_moe_gen(g), tok)


def stack_reasoner_kv(kvs: list[ReasonerKV]) -> ReasonerKV:
    """Batch several single-prompt caches (e.g. the cond and uncond CFG branches) into one.

    Shorter prefixes are right-padded with zeros and masked out, so one Generator pass serves
    sequences whose prompts differ in length.
    """
    lengths = [kv.length for kv in kvs]
    longest = max(lengths)
    if all(n == longest for n in lengths) and all(kv.key_mask is None for kv in kvs):
        keys = [torch.cat(ks, dim=0) for ks in zip(*(kv.keys for kv in kvs), strict=True)]
        values = [torch.cat(vs, dim=0) for vs in zip(*(kv.values for kv in kvs), strict=True)]
        return ReasonerKV(keys, values)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(t, (0, 0, 0, longest - t.shape[2]))

    keys = [torch.cat([pad(k) for k in ks], dim=0) for ks in zip(*(kv.keys for kv in kvs), strict=True)]
    values = [torch.cat([pad(v) for v in vs], dim=0) for vs in zip(*(kv.values for kv in kvs), strict=True)]
    masks = []
    for kv in kvs:
        b = kv.keys[0].shape[0]
        m = kv.key_mask if kv.key_mask is not None else torch.ones(b, kv.length, dtype=torch.bool,
                                                                    device=kv.keys[0].device)
        masks.append(nn.functional.pad(m, (0, longest - kv.length), value=False))
    return ReasonerKV(keys, values, torch.cat(masks, dim=0))
