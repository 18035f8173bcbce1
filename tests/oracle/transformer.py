"""diffusers `Cosmos3OmniTransformer` twins of our tiny configs, with every parameter randomised,
and the reference packing of one request (built with the pipeline's own helper methods)."""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer

from wamrt.model import Cosmos3Config, Cosmos3Transformer


def build_reference(cfg: Cosmos3Config, seed: int) -> Cosmos3OmniTransformer:
    """A diffusers transformer with the same config; all parameters random (norms, embeds included)."""
    kwargs = cfg.to_dict()
    ref = Cosmos3OmniTransformer(**kwargs).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1 or name.endswith("bias.weight"):
                p.copy_(0.3 * noise)
            elif name.endswith("fc.weight"):
                p.copy_(noise / math.sqrt(p.shape[-1] / cfg.hidden_size if "proj_in" in name else cfg.hidden_size))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return ref


def ours_from_reference(ref: Cosmos3OmniTransformer, cfg: Cosmos3Config) -> Cosmos3Transformer:
    model = Cosmos3Transformer(cfg).eval().requires_grad_(False)
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=True)
    return model


@dataclass
class Request:
    """One packed request for both implementations."""

    input_ids: torch.Tensor  # [U]
    vision: torch.Tensor  # [1, C, T, H, W]
    vision_clean_frames: list[int]
    action: torch.Tensor | None  # [Ta, A]
    action_clean_rows: list[int]
    sound: torch.Tensor | None  # [S, Ts]
    domain: int
    timestep: float
    fps: float = 15.0
    sound_fps: float = 25.0


def reference_kwargs(ref: Cosmos3OmniTransformer, req: Request) -> dict:
    """The exact transformer kwargs `Cosmos3OmniPipeline.__call__` would pass for this request."""
    pipe = types.SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)
    P = Cosmos3OmniPipeline
    dev = torch.device("cpu")
    text = P._prepare_text_segment(pipe, req.input_ids.tolist(), device=dev)
    offset, curr = text["vision_start_temporal_offset"], text["und_len"]
    vis = P._prepare_vision_segment(pipe, req.vision, has_image_condition=bool(req.vision_clean_frames),
                                    mrope_offset=offset, vision_fps=req.fps, curr=curr, device=dev,
                                    condition_frame_indexes=req.vision_clean_frames)
    curr += vis["num_vision_tokens"]
    segments = [text["text_mrope_ids"], vis["vision_mrope_ids"]]
    kw = {k: text[k] for k in ("input_ids", "text_indexes", "und_len")}
    kw.update({k: vis[k] for k in ("vision_token_shapes", "vision_sequence_indexes", "vision_mse_loss_indexes",
                                    "vision_noisy_frame_indexes")})
    kw["vision_tokens"] = [req.vision]
    kw["vision_timesteps"] = torch.full((vis["num_noisy_vision_tokens"],), req.timestep)
    if req.sound is not None:
        snd = P._prepare_sound_segment(pipe, req.sound, mrope_offset=offset, sound_fps=req.sound_fps, curr=curr,
                                       device=dev)
        curr += snd["sound_len"]
        segments.append(snd["sound_mrope_ids"])
        kw.update({k: snd[k] for k in ("sound_token_shapes", "sound_sequence_indexes", "sound_mse_loss_indexes",
                                        "sound_noisy_frame_indexes")})
        kw["sound_tokens"] = [req.sound]
        kw["sound_timesteps"] = torch.full((snd["sound_len"],), req.timestep)
    if req.action is not None:
        act = P._prepare_action_segment(pipe, req.action, condition_frame_indexes=req.action_clean_rows,
                                        mrope_offset=offset, action_fps=req.fps, curr=curr, device=dev)
        curr += act["action_len"]
        segments.append(act["action_mrope_ids"])
        kw.update({k: act[k] for k in ("action_token_shapes", "action_sequence_indexes", "action_mse_loss_indexes",
                                        "action_noisy_frame_indexes")})
        kw["action_tokens"] = [req.action]
        kw["action_timesteps"] = torch.full((act["num_noisy_action_tokens"],), req.timestep)
        kw["action_domain_ids"] = [torch.tensor([req.domain])]
    kw["position_ids"] = torch.cat([s.float() for s in segments], dim=1)
    kw["sequence_length"] = curr
    return kw
