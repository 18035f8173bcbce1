"""Flow-matching post-training of a small Cosmos 3 policy through the serving request path.

Per sample (frame t of an expert episode):
  * vision: latent frame 0 = the VAE latent of the observation canvas (clean, exactly what `prepare_droid`
    encodes), latent frames 1..8 = the latents of future frames t+4k (noisy: the auxiliary target);
  * actions: row 0 = the clean DROID state row, rows 1..32 = the expert's next 32 actions in model space
    (gripper flipped, as `droid_actions` flips it back), columns >= 8 zero; both normalized by the statistics
    the checkpoint stores (`wamrt.pipeline.normalization`; `normalization="none"` keeps raw radians);
  * text: the instruction's DROID prompt, replaced by the empty prompt (the CFG unconditional branch) with
    probability `text_dropout`; token ids and the positions of the packed sequence come from the branches
    `prepare_droid` itself builds for that instruction (`request_layout`).
Rectified flow as the sampler defines it (`wamrt.sampler.schedules`): x_sigma = (1 - sigma) x0 + sigma noise,
the model predicts v = noise - x0 at timestep 1000 sigma (UniPC's x0 = x - sigma v; Euler x += dsigma v), sigma
drawn as shift*u / (1 + (shift - 1) u) so training concentrates where the shifted 4-step schedule evaluates.
Loss: masked velocity MSE over the noisy vision frames + action_weight x masked MSE over the noisy action
rows' real columns.

With `prefix_max` > 0 (training-time real-time chunking, arXiv 2512.05964) every sample also draws a prefix length
d (0 with probability `prefix_zero_share`, else uniform in 1..prefix_max): its first d chunk rows stay clean (the
ground truth, no noise, no time embedding), right after the state row, and are left out of the loss -- the packing
a served request with `action_prefix` of d committed rows gets in "clean" mode (`wamrt.pipeline.prefix`).
With `prefix_noise` > 0 those rows are not the ground truth but the ground truth off by a random per-sample joint
offset, and the rows after them are to return from it (`perturb_prefix`): served, the committed rows come from the
policy's own earlier chunk, which is off by about as much as its open-loop error, and a model that only ever saw
right prefixes carries their error on (docs/realtime.md).

Frames recorded by `wamrt eval grid --record-dagger` (eval/dagger.py) bring their own chunk and prefix: the policy's
own committed rows, then the expert's continuation from where they leave the arm; such a sample keeps that prefix
(never perturbed, never redrawn) and has no vision loss (its neighbours are other requests, not future frames).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..model import Cosmos3Transformer, get_config, init_random_, load_transformer
from ..model.rope import Rope
from ..model.transformer import GeneratorTokens, stack_reasoner_kv
from ..pipeline.builtin import write_tokenizer, write_vae
from ..pipeline.denoise import Branch
from ..pipeline.droid import DroidContract, prepare_droid
from ..pipeline.normalization import KEY as NORM_KEY
from ..pipeline.normalization import ActionNormalization
from ..pipeline.prefix import MAX_PREFIX_ROWS
from ..pipeline.tokens import CaptionTokenizer
from ..pipeline.vae import FrameEncoder, load_vae
from .checkpoint import checkpoint_meta, data_summary, ema_model, write_checkpoint
from .config import NORMALIZATIONS, TrainConfig
from .data import DemoSet, chunk_indices
from .samples import augment, perturb_prefix, prefix_action_noisy, sample_prefix_rows, sample_sigmas
from .split import draw_pool, split_frames


@dataclass
class RequestLayout:
    """The fixed packing of one instruction, as `prepare_droid` builds it."""

    cond: Branch
    uncond: Branch
    vision_noisy: torch.Tensor  # [1, T]
    action_noisy: torch.Tensor  # [1, rows]
    domain_id: int
    raw_action_dim: int
    latent_thw: tuple[int, int, int]


def request_layout(instruction: str, *, model: Cosmos3Transformer, encoder: FrameEncoder,
                   tokenizer: CaptionTokenizer, contract: DroidContract, device: torch.device) -> RequestLayout:
    """Run the inference preparation itself on a blank observation with this instruction and keep what does
    not depend on pixels or state: token ids, positions, masks (the DROID canvas is always 540x640)."""
    obs = {"observation/image": np.zeros((540, 640, 3), np.uint8), "observation/joint_position": np.zeros(7),
           "observation/gripper_position": 0.0, "prompt": instruction}
    prep = prepare_droid(obs, model=model, encoder=encoder, tokenizer=tokenizer, contract=contract, seed=0,
                         device=device)
    inp = prep.inputs
    assert inp.uncond is not None and inp.action_noisy is not None and inp.domain_ids is not None
    _, _, t, h, w = inp.vision.shape
    return RequestLayout(inp.cond, inp.uncond, inp.vision_noisy, inp.action_noisy, int(inp.domain_ids[0]),
                         int(inp.raw_action_dim or 8), (t, h, w))


def training_init_(model: Cosmos3Transformer, seed: int) -> Cosmos3Transformer:
    """Seeded start: N/sqrt(fan_in) matrices, unit norms, zero biases/modality embeddings, small output heads."""
    init_random_(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.split(".")[-2] if "." in name else ""
            if "norm" in owner:
                p.fill_(1.0)
            elif p.ndim == 1 or name.endswith("bias.weight"):
                p.zero_()
        model.proj_out.weight.mul_(0.1)
        model.action_proj_out.fc.weight.mul_(0.1)
    return model


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    elapsed_s: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


class PolicyTrainer:
    """Owns the model, its frozen VAE and tokenizer (written into `out_dir` first), the data and the loop."""

    def __init__(self, cfg: TrainConfig, ds: DemoSet, out_dir: str | Path, *, device: str | torch.device | None = None,
                 log_path: str | Path | None = None) -> None:
        self.cfg, self.ds = cfg, ds
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_path) if log_path else self.out / "train_log.txt"
        if ds.tier != cfg.tier:
            raise ValueError(f"demos were recorded at tier {ds.tier}, training asks for tier {cfg.tier}")
        split = split_frames(ds, cfg)
        self.train_idx, self.val_idx, self.val_dagger_idx = split.train, split.val, split.val_dagger
        if cfg.keep_best and self.val_idx is None and self.val_dagger_idx is None:
            raise ValueError("keep_best needs held-out episodes: set val_episodes or val_dagger_episodes")
        # keep_best: {"step", "metric", "value", "weights" (EMA tensors)} of the lowest held-out EMA loss so far, and
        # the last step scored (the loop's end scores its final weights unless a log line just did)
        self.best: dict[str, Any] | None = None
        self.scored_step: int | None = None
        if cfg.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {cfg.normalization!r}")
        if cfg.prefix_noise < 0 or cfg.prefix_noise_rows < 0:
            raise ValueError(f"prefix_noise and prefix_noise_rows must be >= 0, got {cfg.prefix_noise}, "
                             f"{cfg.prefix_noise_rows}")
        if cfg.gripper_loss_weight <= 0:
            raise ValueError(f"gripper_loss_weight must be > 0, got {cfg.gripper_loss_weight}")
        if cfg.seam_weight <= 0 or cfg.seam_rows < 0:
            raise ValueError(f"seam_weight must be > 0 and seam_rows >= 0, got {cfg.seam_weight}, {cfg.seam_rows}")
        if cfg.dagger_repeat < 1 or (cfg.dagger_d0_repeat is not None and cfg.dagger_d0_repeat < 1) \
                or cfg.dagger_disagree_repeat < 1:
            raise ValueError(f"dagger_repeat, dagger_d0_repeat and dagger_disagree_repeat must be >= 1, got "
                             f"{cfg.dagger_repeat}, {cfg.dagger_d0_repeat}, {cfg.dagger_disagree_repeat}")
        if not 0 <= cfg.prefix_max <= MAX_PREFIX_ROWS or not 0.0 <= cfg.prefix_zero_share <= 1.0:
            raise ValueError(f"prefix_max must be in [0, {MAX_PREFIX_ROWS}] and prefix_zero_share in [0, 1], got "
                             f"{cfg.prefix_max}, {cfg.prefix_zero_share}")
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.np_rng = np.random.default_rng(cfg.seed)
        cuda = self.device.type == "cuda"
        # The VAE runs in the dtype the served policy uses on this device (load_policy: bf16 on CUDA).
        self.vae_dtype = torch.bfloat16 if cuda else torch.float32
        init = Path(cfg.init_from) if cfg.init_from else None
        if init is not None:  # continue a checkpoint: its VAE, its output space, its weights
            if not (init / "wamrt.json").is_file() or not (init / "transformer").is_dir():
                raise ValueError(f"init_from {init} is not a trained checkpoint (no wamrt.json / transformer/)")
            shutil.copytree(init / "vae", self.out / "vae", dirs_exist_ok=True)
        else:
            write_vae(self.out / "vae", cfg.vae_seed)  # frozen random Wan2.2-layout VAE (see docs/train.md)
        write_tokenizer(self.out / "tokenizer")
        self.encoder = FrameEncoder(load_vae(self.out / "vae", device=self.device, dtype=self.vae_dtype))
        self.tokenizer = CaptionTokenizer.from_pretrained(self.out / "tokenizer")
        if init is not None:  # the statistics the weights were trained against, not refitted ones
            stored = json.loads((init / "wamrt.json").read_text()).get(NORM_KEY)
            self.normalization = (ActionNormalization.from_json(stored, raw_dim=DroidContract.raw_action_dim,
                                                                  chunk=DroidContract.chunk)
                                  if stored is not None else None)
        else:
            self.normalization = self.fit_normalization() if cfg.normalization != "none" else None
        self.contract = DroidContract(prompt_format="plain", tier=cfg.tier, normalization=self.normalization)
        self.model = training_init_(Cosmos3Transformer(get_config(cfg.size)), cfg.seed).to(self.device).train()
        if init is not None:
            start = load_transformer(init / "transformer", device=self.device, dtype=torch.float32)
            if start.config != self.model.config:
                raise ValueError(f"init_from {init} holds a different model than --size {cfg.size}")
            self.model.load_state_dict(start.state_dict())
        self.ema = [p.detach().clone().float() for p in self.model.parameters()]
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim == 1 or "norm" in name or "embed" in name else decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                                     fused=cuda)
        self.autocast = cuda
        # Layouts per instruction (+ the shared unconditional branch), built by prepare_droid itself.
        self.layouts: dict[str, RequestLayout] = {}
        with torch.no_grad():
            for p in sorted(set(ds.prompt)):
                self.layouts[p] = request_layout(p, model=self.model, encoder=self.encoder, tokenizer=self.tokenizer,
                                                 contract=self.contract, device=self.device)
        first = next(iter(self.layouts.values()))
        self.latent_thw = first.latent_thw
        self.branches: dict[str, Branch] = {"": first.uncond}
        for p, lay in self.layouts.items():
            self.branches[p] = lay.cond
        self.prompt_ids = np.array([sorted(self.layouts).index(p) for p in ds.prompt])
        self.prompt_names = sorted(self.layouts)
        # Data and indexing on the device (a host-to-device copy from pageable memory drains the stream, so
        # none happens inside a training step): uint8 canvases, state rows, actions, episode ends.
        self.canvas = torch.from_numpy(ds.canvas).to(self.device)
        self.raw_state = torch.from_numpy(ds.state).to(self.device)  # model space (gripper flipped), raw
        model_state = self.normalization.state_in(ds.state) if self.normalization is not None else ds.state
        self.state_rows = torch.from_numpy(np.ascontiguousarray(model_state)).to(self.device)
        self.actions = torch.from_numpy(ds.actions).to(self.device)
        self.episode_end = torch.from_numpy(ds.episode_end).to(self.device)
        # DAgger frames (eval/dagger.py) bring their own chunk and clean prefix, and have no future frames.
        self.chunk_row = self.chunks = self.fixed_prefix = self.grip_learnt = None
        if ds.chunks is not None and ds.chunk_row is not None and ds.fixed_prefix is not None:
            self.chunk_row = torch.from_numpy(ds.chunk_row).to(self.device)
            self.chunks = torch.from_numpy(ds.chunks).to(self.device)
            self.fixed_prefix = torch.from_numpy(ds.fixed_prefix).to(self.device)
            unseen = ds.grasp_unseen if ds.grasp_unseen is not None and cfg.mask_unseen_grasps \
                else np.zeros(len(ds.chunks), bool)
            self.grip_learnt = torch.from_numpy(~unseen).float().to(self.device)  # [M]: 0 leaves the column out
        norm = self.normalization.arrays() if self.normalization is not None else None
        self._norm = {k: torch.from_numpy(v).to(self.device) for k, v in norm.items()} if norm else None
        # Training frames per instruction (prompt_batches) and how often each instruction is drawn.
        sample_idx = draw_pool(ds, self.train_idx, cfg)
        train_prompts = self.prompt_ids[sample_idx]
        self.prompt_pools = [torch.from_numpy(sample_idx[train_prompts == i]).to(self.device)
                             for i in range(len(self.prompt_names))]
        counts = np.array([len(p) for p in self.prompt_pools], np.float64)
        self.prompt_weights = counts / counts.sum()
        self.train_idx_t = torch.from_numpy(sample_idx).to(self.device)
        self.state = TrainState()
        self._latent_cache: torch.Tensor | None = None

    def fit_normalization(self) -> ActionNormalization:
        """Statistics of the training frames only (held-out episodes excluded), in model space."""
        ds, idx = self.ds, self.train_idx
        chunks = ds.actions[chunk_indices(ds, idx, DroidContract.chunk)].copy()  # [N, chunk, 8]
        chunks[..., -1] = 1.0 - chunks[..., -1]
        relative = self.cfg.normalization == "relative"
        return ActionNormalization.fit(ds.state[idx], chunks, tuple([relative] * 7 + [False]))

    @property
    def uses_latent_cache(self) -> bool:
        """Every path but `aug_future` with augmentation on reads clean latents from the cache."""
        augmenting = bool(self.cfg.aug_shift_px or self.cfg.aug_colour)
        return not (augmenting and self.cfg.aug_future)

    def cache_latents(self, chunk: int = 64) -> None:
        """Encode every frame once (exact when augmentation is off; makes CPU training ~10x faster)."""
        parts = []
        for i in range(0, len(self.canvas), chunk):
            px = self.canvas[i:i + chunk].permute(0, 3, 1, 2).float()[:, None]  # [n, 1, 3, H, W]
            parts.append(self.encode_frames(px)[:, :, 0])  # [n, C, h, w]
        self._latent_cache = torch.cat(parts)

    # ---- batch ---------------------------------------------------------------------------------------------
    def encode_frames(self, pixels: torch.Tensor) -> torch.Tensor:
        """float pixels [B, F, 3, H, W] in [0, 255] -> latents [B, C, F, lat_h, lat_w] (content crop, as at
        inference: `prepare_droid` keeps latent0[..., :lat_h, :lat_w])."""
        b, f, c, h, w = pixels.shape
        x = (pixels.reshape(b * f, c, 1, h, w) / 127.5 - 1.0)
        with torch.no_grad():
            lat = self.encoder.encode(x).clone()  # [B*F, C, 1, h/16, w/16]; clone leaves inference mode
        _, lh, lw = self.latent_thw
        lat = lat[..., :lh, :lw]
        return lat.reshape(b, f, *lat.shape[1:2], lh, lw).permute(0, 2, 1, 3, 4).contiguous()

    def clean_batch(self, idx: np.ndarray | torch.Tensor, *, augment_images: bool = True,
                    prompts: list[str] | None = None) -> dict[str, Any]:
        """The clean (x0) tensors of samples `idx` (frame indices, numpy or on the device): vision latents
        [B, C, T, h, w], actions [B, rows, 64] (normalized as the contract says), and their instructions."""
        if isinstance(idx, np.ndarray):
            prompts = prompts or [self.prompt_names[i] for i in self.prompt_ids[idx]]
            idx = torch.from_numpy(idx).to(self.device)
        assert prompts is not None and len(prompts) == len(idx)
        lat_t = self.latent_thw[0]
        last = self.episode_end[idx, None] - 1
        # Latent frame k stands for pixel frame t + 4k, clamped to the episode: latent frame k of a causal Wan clip
        # covers pixel frames 4k-3..4k, and the target uses the single-frame latent of its last frame (frame 0 is
        # exact; the future frames approximate the clip latent and serve only as the auxiliary vision target).
        frames = torch.minimum(idx[:, None] + self.encoder.temporal * torch.arange(lat_t, device=self.device), last)
        explicit = row = None
        if self.chunk_row is not None:  # a DAgger frame's neighbours are other requests: its frame 0 stands in
            row = self.chunk_row[idx]
            explicit = row >= 0
            frames = torch.where(explicit[:, None], idx[:, None], frames)
        aug = augment_images and bool(self.cfg.aug_shift_px or self.cfg.aug_colour)
        if self._latent_cache is not None and not aug:
            vision = self._latent_cache[frames].permute(0, 2, 1, 3, 4).contiguous()  # [B, C, T, h, w]
        elif self._latent_cache is not None and not self.cfg.aug_future:
            pixels = self.canvas[frames[:, :1]].permute(0, 1, 4, 2, 3).float()  # [B, 1, 3, H, W]
            first = self.encode_frames(augment(pixels, self.gen, self.cfg.aug_shift_px, self.cfg.aug_colour))
            future = self._latent_cache[frames[:, 1:]].permute(0, 2, 1, 3, 4).to(first.dtype)
            vision = torch.cat([first, future], dim=2).contiguous()
        else:
            pixels = self.canvas[frames].permute(0, 1, 4, 2, 3).float()  # [B, T, 3, H, W]
            if aug:
                pixels = augment(pixels, self.gen, self.cfg.aug_shift_px, self.cfg.aug_colour)
            vision = self.encode_frames(pixels)
        b = len(idx)
        rows = self.contract.chunk + self.contract.history
        width = self.model.config.action_dim or 64
        action = torch.zeros(b, rows, width, device=self.device)
        action[:, 0, :8] = self.state_rows[idx]
        steps = torch.minimum(idx[:, None] + torch.arange(self.contract.chunk, device=self.device), last)
        chunk = self.actions[steps].clone()
        extra: dict[str, torch.Tensor] = {}
        if explicit is not None and row is not None and self.chunks is not None and self.fixed_prefix is not None:
            chunk = torch.where(explicit[:, None, None], self.chunks[row.clamp(min=0)], chunk)
            extra = {"fixed_prefix": self.fixed_prefix[idx], "vision_weight": (~explicit).float()}
            if self.grip_learnt is not None:
                extra["gripper_weight"] = torch.where(explicit, self.grip_learnt[row.clamp(min=0)], 1.0)
        chunk[..., -1] = 1.0 - chunk[..., -1]  # model space: the gripper flipped (droid_actions flips back)
        if self._norm is not None:  # the inverse of ActionNormalization.actions_out, on the device
            n = self._norm
            chunk = (chunk - self.raw_state[idx, None, :] * n["relative"] - n["action_mean"]) / n["action_std"]
        action[:, self.contract.history:, :8] = chunk
        return {"vision": vision, "action": action, "prompts": list(prompts), **extra}

    # ---- forward / loss ------------------------------------------------------------------------------------
    def velocity(self, prompts: list[str], sigma: torch.Tensor, x_v: torch.Tensor, x_a: torch.Tensor,
                 action_noisy: torch.Tensor | None = None):
        """The Generator's velocities for a batch, each sample against its own branch (cond or uncond),
        exactly as the denoising loop calls it: Reasoner K/V per prompt, then one Generator pass. action_noisy
        [B, rows]: the generated action rows (default: all but the state row)."""
        model = self.model
        kvs: dict[str, Any] = {}
        ropes: dict[str, Rope] = {}
        for p in sorted(set(prompts)):
            br = self.branches[p]
            r_und, r_gen = model.rope(br.positions).split(br.input_ids.shape[1])
            kvs[p] = model.prefill_reasoner(br.input_ids, r_und)
            ropes[p] = r_gen
        kv = stack_reasoner_kv([kvs[p] for p in prompts])
        rope = Rope(torch.cat([ropes[p].cos for p in prompts]), torch.cat([ropes[p].sin for p in prompts]))
        lay = next(iter(self.layouts.values()))
        b = len(prompts)
        tok = GeneratorTokens(
            timesteps=sigma * 1000.0, vision=x_v, vision_noisy=lay.vision_noisy.expand(b, -1),
            action=x_a, action_noisy=lay.action_noisy.expand(b, -1) if action_noisy is None else action_noisy,
            domain_ids=torch.full((b,), lay.domain_id, device=self.device, dtype=torch.long),
        )
        return model.generator_step(tok, rope, kv)

    def prefix_rows(self, b: int, gen: torch.Generator) -> torch.Tensor:
        """[b] prefix lengths of a training batch (all 0 without `prefix_max`; no draw then, so a run without
        prefixes consumes its random stream as before)."""
        if not self.cfg.prefix_max:
            return torch.zeros(b, dtype=torch.long, device=self.device)
        return sample_prefix_rows(b, self.cfg.prefix_max, self.cfg.prefix_zero_share, gen, self.device)

    def loss(self, batch: dict[str, Any], sigma: torch.Tensor | None = None, *, gen: torch.Generator | None = None,
             text_dropout: bool = True, perturbed: bool = True) -> dict[str, torch.Tensor]:
        """`batch["prefix_rows"]` [B] (optional) fixes the samples' prefix lengths; else they are drawn.
        perturbed=False: ground-truth prefixes even with `prefix_noise` (the held-out loss, comparable across
        runs)."""
        cfg = self.cfg
        gen = gen or self.gen
        v0, a0 = batch["vision"], batch["action"]
        b = v0.shape[0]
        lay = next(iter(self.layouts.values()))
        if sigma is None:
            sigma = sample_sigmas(b, cfg.sigma_shift, gen, self.device)
        prompts = list(batch["prompts"])
        if text_dropout and cfg.text_dropout > 0 and not batch.get("dropout_done"):
            drop = torch.rand(b, generator=gen, device=self.device) < cfg.text_dropout
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        vn = lay.vision_noisy[0][None, None, :, None, None]  # [1, 1, T, 1, 1]
        cols = torch.arange(a0.shape[-1], device=self.device) < lay.raw_action_dim
        d = batch.get("prefix_rows")
        d = self.prefix_rows(b, gen) if d is None else d
        fixed = batch.get("fixed_prefix")  # DAgger frames: the prefix their request carried
        if fixed is not None:
            d = torch.where(fixed >= 0, fixed, d)
        action_noisy = prefix_action_noisy(d, a0.shape[1], self.contract.history)  # [B, rows]
        an = action_noisy[:, :, None] & cols[None, None, :]  # [B, rows, A]: noised, and in the loss
        eps_v = torch.randn(v0.shape, generator=gen, device=self.device)
        eps_a = torch.randn(a0.shape, generator=gen, device=self.device)
        a_in = a0
        if cfg.prefix_noise > 0 and perturbed:  # a0 becomes the target the noisy rows are denoised towards
            # the DROID row: 7 joint positions, then the gripper (never perturbed: it is open or closed)
            a_in, target = perturb_prefix(a0, d, self.contract.history, lay.raw_action_dim - 1, cfg.prefix_noise,
                                          cfg.prefix_noise_rows, gen)
            if fixed is not None:  # a DAgger prefix is the policy's own already: never perturbed
                own = (fixed >= 0)[:, None, None]
                a_in, target = torch.where(own, a0, a_in), torch.where(own, a0, target)
            a0 = target
        s_v, s_a = sigma.view(b, 1, 1, 1, 1), sigma.view(b, 1, 1)
        x_v = torch.where(vn, (1 - s_v) * v0 + s_v * eps_v, v0)
        x_a = torch.where(an, (1 - s_a) * a0 + s_a * eps_a, a_in)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.velocity(prompts, sigma, x_v, x_a, action_noisy)
        assert out.vision is not None and out.action is not None
        mv = vn.expand_as(v0).float()
        if (weight := batch.get("vision_weight")) is not None:  # DAgger frames: no future frames to predict
            mv = mv * weight.view(b, 1, 1, 1, 1)
        ma = an.expand_as(a0).float()
        if cfg.seam_weight != 1.0 and cfg.seam_rows > 0:
            after = torch.arange(a0.shape[1], device=self.device)[None] - self.contract.history - d[:, None]
            seam = (d[:, None] > 0) & (after >= 0) & (after < cfg.seam_rows)  # [B, rows]
            ma = ma * torch.where(seam, cfg.seam_weight, 1.0)[:, :, None]
        is_grip = torch.arange(a0.shape[-1], device=self.device) == lay.raw_action_dim - 1  # the raw row's last
        if cfg.gripper_loss_weight != 1.0:
            ma = ma * torch.where(is_grip, cfg.gripper_loss_weight, 1.0)[None, None, :]
        if (grip := batch.get("gripper_weight")) is not None:
            ma = ma * torch.where(is_grip[None, None, :], grip.view(b, 1, 1), 1.0)
        lv = (((out.vision.float() - (eps_v - v0)) ** 2) * mv).sum() / mv.sum().clamp(min=1.0)
        la = (((out.action.float() - (eps_a - a0)) ** 2) * ma).sum() / ma.sum()
        return {"loss": lv + cfg.action_weight * la, "vision": lv, "action": la}

    # ---- optimisation --------------------------------------------------------------------------------------
    def lr_at(self, progress: float) -> float:
        cfg = self.cfg
        warm = min(1.0, (self.state.step + 1) / max(1, cfg.warmup))
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.lr * warm * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * cos)

    def sample_batch(self) -> tuple[torch.Tensor, list[str], bool]:
        """Frame indices of one training batch (on the device) and their prompts; with `prompt_batches` one
        instruction for the whole batch, replaced by the unconditional prompt with probability text_dropout
        (the third value says that this text dropout was already applied)."""
        cfg = self.cfg
        if not cfg.prompt_batches:
            pick = torch.randint(0, len(self.train_idx_t), (cfg.batch,), generator=self.gen, device=self.device)
            idx = self.train_idx_t[pick]
            return idx, [self.prompt_names[i] for i in self.prompt_ids[idx.cpu().numpy()]], False
        p = int(self.np_rng.choice(len(self.prompt_pools), p=self.prompt_weights))
        pool = self.prompt_pools[p]
        idx = pool[torch.randint(0, len(pool), (cfg.batch,), generator=self.gen, device=self.device)]
        name = "" if self.np_rng.random() < cfg.text_dropout else self.prompt_names[p]
        return idx, [name] * cfg.batch, True

    def val_loss(self) -> dict[str, float] | None:
        """Loss of the live (not EMA) weights on the fixed held-out batches (`val_action` / `val_vision` on the
        held-out episodes, `val_dagger_action` on the held-out DAgger episodes): same sigmas and noise every time,
        no text dropout, no grad."""
        batches = {name: idx for name, idx in (("val", self.val_idx), ("val_dagger", self.val_dagger_idx))
                   if idx is not None}
        if not batches:
            return None
        was_training = self.model.training
        self.model.eval()
        out: dict[str, float] = {}
        with torch.no_grad():
            for name, idx in batches.items():
                gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 1)
                losses = self.loss(self.clean_batch(idx, augment_images=False), gen=gen, text_dropout=False,
                                   perturbed=False)
                out[f"{name}_action"] = float(losses["action"])
                if name == "val":  # a DAgger frame has no future frames: no vision loss
                    out["val_vision"] = float(losses["vision"])
        self.model.train(was_training)
        return out

    def ema_val_loss(self) -> dict[str, float] | None:
        """`val_loss` of the EMA weights (what `save` writes): swapped into the live model and back."""
        params = list(self.model.parameters())
        with torch.no_grad():
            live = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, [e.to(p.dtype) for p, e in zip(params, self.ema, strict=True)])
            try:
                return self.val_loss()
            finally:
                torch._foreach_copy_(params, live)

    def track_best(self) -> str:
        """keep_best: score the EMA weights on the held-out batch and keep them where they are the best so far.
        Returns the log text (' ema val dagger 0.39 (best)')."""
        val = self.ema_val_loss() or {}
        self.scored_step = self.state.step
        key, label = (("val_dagger_action", "val dagger") if "val_dagger_action" in val
                      else ("val_action", "val action"))
        value = val[key]
        better = self.best is None or value < self.best["value"]
        if better:
            self.best = {"step": self.state.step, "metric": key, "value": value,
                         "weights": [e.detach().clone() for e in self.ema]}
        return f"  ema {label} {value:.5f}{' (best)' if better else ''}"

    def train_step(self, progress: float = 0.0, *, sync: bool = True) -> dict[str, Any]:
        """One optimiser step. sync=False returns the metrics as one device tensor [loss, action, vision,
        grad norm] (no host sync: the training loop reads them at log time) plus the learning rate."""
        lr = self.lr_at(progress)
        for g in self.opt.param_groups:
            g["lr"] = lr
        idx, prompts, dropped = self.sample_batch()
        batch = self.clean_batch(idx, prompts=prompts)
        batch["dropout_done"] = dropped
        losses = self.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        decay = min(self.cfg.ema, (1 + self.state.step) / (10 + self.state.step))
        with torch.no_grad():
            params = [p.detach().float() for p in self.model.parameters()]
            torch._foreach_lerp_(self.ema, params, 1 - decay)
        self.state.step += 1
        self.state.samples += self.cfg.batch
        vals = torch.stack([losses["loss"].detach(), losses["action"].detach(), losses["vision"].detach(),
                            gnorm.detach().float()])
        if not sync:
            return {"metrics": vals, "lr": lr}
        v = vals.tolist()
        return {"loss": v[0], "action": v[1], "vision": v[2], "lr": lr, "grad_norm": v[3]}

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def train(self) -> TrainState:
        cfg = self.cfg
        budget = cfg.minutes * 60.0
        self.log(f"train: {json.dumps(asdict(cfg))}")
        self.log(f"data: {self.ds.episodes} episodes, {len(self.ds)} frames, prompts {len(self.layouts)}, "
                 f"latent {self.latent_thw}, device {self.device}, "
                 f"params {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f} M, "
                 f"held out {cfg.val_episodes} episodes + {cfg.val_dagger_episodes} DAgger episodes "
                 f"({len(self.ds) - len(self.train_idx)} frames)")
        if self.ds.chunk_row is not None:
            unseen = 0 if self.ds.grasp_unseen is None else int(self.ds.grasp_unseen.sum())
            disagree = 0 if self.ds.grip_disagrees is None else int(self.ds.grip_disagrees.sum())
            self.log(f"dagger: {int((self.ds.chunk_row >= 0).sum())} requests, {unseen} marked grasp_unseen "
                     f"({'gripper left out after the prefix' if cfg.mask_unseen_grasps else 'learnt as labelled'}), "
                     f"{disagree} with the reply's gripper against the label's (drawn x{cfg.dagger_disagree_repeat})")
        if cfg.keep_best:  # the starting weights count: a run that never beats them saves them
            self.log(f"step      0{self.track_best()}")
        t0 = time.perf_counter()
        win_t, win_n, acc = t0, 0, []
        snapshots = sorted(cfg.snapshot_minutes)
        while True:
            elapsed = time.perf_counter() - t0
            if snapshots and elapsed >= 60.0 * snapshots[0]:
                m = snapshots.pop(0)
                self.state.elapsed_s = elapsed
                folder = self.save(folder=self.out / "snapshots" / f"{m:g}min")
                self.log(f"snapshot: {folder} at step {self.state.step}")
            progress = elapsed / budget if budget > 0 else 1.0
            if cfg.max_steps is not None:
                progress = max(progress, self.state.step / cfg.max_steps)
            if progress >= 1.0:
                break
            m = self.train_step(progress, sync=False)
            acc.append(m)
            win_n += cfg.batch
            if self.state.step % cfg.log_every == 0 or self.state.step == 1:
                now = time.perf_counter()
                vals = torch.stack([a["metrics"] for a in acc]).mean(0).tolist()  # the window's one host sync
                mean = {"loss": vals[0], "action": vals[1], "vision": vals[2], "grad_norm": vals[3],
                        "lr": float(np.mean([a["lr"] for a in acc]))}
                if not math.isfinite(mean["loss"]):
                    raise FloatingPointError(f"non-finite loss by step {self.state.step}: {mean}")
                rate = win_n / max(now - win_t, 1e-9)
                val = self.val_loss() or {}
                rec = {"step": self.state.step, "elapsed_s": round(now - t0, 1), **mean, **val, "samples_per_s": rate}
                self.state.history.append(rec)
                held = "".join(f"  {label} {val[key]:.5f}" for key, label in
                               (("val_action", "val action"), ("val_dagger_action", "val dagger")) if key in val)
                if cfg.keep_best:
                    held += self.track_best()
                self.log(f"step {self.state.step:6d}  t {now - t0:7.1f}s  loss {mean['loss']:.4f}  "
                         f"action {mean['action']:.5f}  vision {mean['vision']:.4f}{held}  lr {mean['lr']:.2e}  "
                         f"gnorm {mean['grad_norm']:.2f}  {rate:.1f} samples/s")
                win_t, win_n, acc = time.perf_counter(), 0, []
        self.state.elapsed_s = time.perf_counter() - t0
        if cfg.keep_best and self.scored_step != self.state.step:
            self.log(f"step {self.state.step:6d}  (last){self.track_best()}")
        self.log(f"done: {self.state.step} steps, {self.state.samples} samples in {self.state.elapsed_s:.1f}s"
                 + (f"; saving the EMA weights of step {self.best['step']} ({self.best['metric']} "
                    f"{self.best['value']:.5f})" if self.best is not None else ""))
        return self.state

    # ---- checkpoint (checkpoint.py) --------------------------------------------------------------------------
    def ema_model(self, weights: list[torch.Tensor] | None = None) -> Cosmos3Transformer:
        return ema_model(self.model.config, self.ema if weights is None else weights)

    def save(self, extra: dict[str, Any] | None = None, folder: str | Path | None = None) -> Path:
        """The run's checkpoint in `out_dir` (under keep_best the best EMA weights, else the current ones);
        `folder` (a snapshot): the current EMA weights as a complete checkpoint elsewhere."""
        out = Path(folder) if folder is not None else self.out
        best = self.best if out == self.out else None
        kept = {"kept_best": {k: best[k] for k in ("step", "metric", "value")}} if best is not None else {}
        meta = checkpoint_meta(self.cfg, self.normalization, steps=self.state.step, samples=self.state.samples,
                               elapsed_s=self.state.elapsed_s,
                               train={**data_summary(self.ds), **kept, **(extra or {})})
        return write_checkpoint(out, self.ema_model(best["weights"] if best is not None else None), meta,
                                assets_from=self.out)
