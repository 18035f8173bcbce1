"""The peer: diffusers 0.42.1's own Cosmos 3 policy loop on the same weights, in the same process.

Per request it does what `Cosmos3OmniPipeline.__call__` does for an action policy: encode the
conditioning clip (the image repeated chunk+1 = 33 times) with the VAE, pack both prompts with the
pipeline's own helpers, then per step a full conditional and a full unconditional transformer call,
velocity masking, CFG in fp32 and one `UniPCMultistepScheduler` step per modality.
"""

from __future__ import annotations

import copy
import time
import types

import torch
from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

from ..model import Cosmos3Transformer
from ..pipeline.vae import FrameEncoder


def diffusers_twin(model: Cosmos3Transformer) -> Cosmos3OmniTransformer:
    """A diffusers transformer sharing our (unfused) weight tensors: no extra memory."""
    cfg = model.config
    with torch.device("meta"):
        ref = Cosmos3OmniTransformer(**cfg.to_dict())
    del ref.lm_head
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False, assign=True)
    assert not unexpected and not missing, (missing, unexpected)
    dev = next(model.parameters()).device
    d = cfg.head_dim
    ref.rotary_emb.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
    return ref.eval().requires_grad_(False)


def diffusers_unipc(shift: float) -> UniPCMultistepScheduler:
    """The flow UniPC scheduler in Cosmos 3's configuration."""
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, solver_order=2, prediction_type="flow_prediction", predict_x0=True,
        solver_type="bh2", lower_order_final=True, use_flow_sigmas=True, flow_shift=shift,
        use_karras_sigmas=False, final_sigmas_type="zero")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class DiffusersPeer:
    def __init__(self, ref: Cosmos3OmniTransformer, encoder: FrameEncoder, *, steps: int, guidance: float,
                 shift: float, chunk: int = 32, raw_action_dim: int = 8, domain_id: int = 8) -> None:
        self.ref, self.encoder = ref, encoder
        self.steps, self.guidance, self.chunk = steps, guidance, chunk
        self.raw_dim, self.domain = raw_action_dim, domain_id
        self.sched = diffusers_unipc(shift)
        self.fake_pipe = types.SimpleNamespace(transformer=ref, vae_scale_factor_temporal=4)

    def _pack(self, ids: list[int], latents: torch.Tensor, actions: torch.Tensor, fps: float) -> dict:
        P, dev = Cosmos3OmniPipeline, latents.device
        text = P._prepare_text_segment(self.fake_pipe, ids, device=dev)
        off = text["vision_start_temporal_offset"]
        vis = P._prepare_vision_segment(self.fake_pipe, latents, has_image_condition=True, mrope_offset=off,
                                        vision_fps=fps, curr=text["und_len"], device=dev, condition_frame_indexes=[0])
        act = P._prepare_action_segment(self.fake_pipe, actions, condition_frame_indexes=[], mrope_offset=off,
                                        action_fps=fps, curr=text["und_len"] + vis["num_vision_tokens"], device=dev)
        keys = ("input_ids", "text_indexes", "und_len", "vision_token_shapes", "vision_sequence_indexes",
                "vision_mse_loss_indexes", "vision_noisy_frame_indexes", "action_token_shapes",
                "action_sequence_indexes", "action_mse_loss_indexes", "action_noisy_frame_indexes")
        kw = {k: {**text, **vis, **act}[k] for k in keys}
        kw["position_ids"] = torch.cat([text["text_mrope_ids"], vis["vision_mrope_ids"], act["action_mrope_ids"]], 1)
        kw["sequence_length"] = text["und_len"] + vis["num_vision_tokens"] + act["action_len"]
        kw["_noisy"] = (vis["num_noisy_vision_tokens"], act["num_noisy_action_tokens"])
        return kw

    @torch.inference_mode()
    def run(self, padded_canvas: torch.Tensor, cond_ids: list[int], uncond_ids: list[int], content_hw: tuple[int, int],
            gen: torch.Generator, fps: float = 15.0) -> dict[str, float]:
        """padded_canvas uint8 [H, W, 3] on the device. Returns stage timings (ms)."""
        dev, dtype = padded_canvas.device, self.ref.dtype
        timings: dict[str, float] = {}
        _sync(dev)
        t0 = time.perf_counter()
        pixels = padded_canvas.permute(2, 0, 1).float() / 127.5 - 1.0
        clip = pixels[None, :, None].expand(-1, -1, self.chunk + 1, -1, -1)
        lat = self.encoder.encode(clip)  # [1, 48, 9, H/16, W/16], the reference's full-clip encode
        lh, lw = content_hw[0] // 16, content_hw[1] // 16
        lat = lat[..., :lh, :lw].contiguous()
        _sync(dev)
        timings["vae_encode"] = 1e3 * (time.perf_counter() - t0)

        t0 = time.perf_counter()
        cond_mask = torch.zeros((lat.shape[2], 1, 1), device=dev)
        cond_mask[0] = 1.0
        noise = torch.randn(lat.shape, generator=gen, device=dev)
        latents = cond_mask * lat + (1 - cond_mask) * noise  # [1, 48, T, h, w]
        act_dim = self.ref.config.action_dim
        actions = torch.randn((self.chunk, act_dim), generator=gen, device=dev)
        actions[:, self.raw_dim:] = 0
        act_mask = torch.zeros((self.chunk, 1), device=dev)
        packs = [self._pack(cond_ids, latents, actions, fps), self._pack(uncond_ids, latents, actions, fps)]
        sched = self.sched
        sched.set_timesteps(self.steps, device=dev)
        act_sched = copy.deepcopy(sched)
        domain = torch.tensor([self.domain], device=dev)
        mask_fn = Cosmos3OmniPipeline._mask_velocity_predictions
        for t in sched.timesteps:
            timestep = t.item()
            outs = []
            for kw in packs[: 2 if self.guidance != 1.0 else 1]:
                kw = dict(kw)
                nv, na = kw.pop("_noisy")
                pv, ps, pa = self.ref(**kw, vision_tokens=[latents.to(dtype)],
                                      vision_timesteps=torch.full((nv,), timestep, device=dev),
                                      action_tokens=[actions.to(dtype)],
                                      action_timesteps=torch.full((na,), timestep, device=dev),
                                      action_domain_ids=[domain], return_dict=False)
                v, _, a = mask_fn(pv, ps, vision_condition_mask=[cond_mask], preds_action=pa,
                                  action_condition_mask=[act_mask], raw_action_dim=self.raw_dim)
                outs.append((v.float(), a.float()))
            if len(outs) == 2:
                vel_v = outs[1][0] + self.guidance * (outs[0][0] - outs[1][0])
                vel_a = outs[1][1] + self.guidance * (outs[0][1] - outs[1][1])
            else:
                vel_v, vel_a = outs[0]
            latents = sched.step(vel_v.unsqueeze(0), t, latents.unsqueeze(0), return_dict=False)[0].squeeze(0)
            actions = act_sched.step(vel_a.unsqueeze(0), t, actions.unsqueeze(0), return_dict=False)[0].squeeze(0)
            actions[:, self.raw_dim:] = 0
        out = actions[:, : self.raw_dim].cpu()
        timings["denoise"] = 1e3 * (time.perf_counter() - t0)
        timings["total"] = timings["vae_encode"] + timings["denoise"]
        assert torch.isfinite(out).all()
        return timings
