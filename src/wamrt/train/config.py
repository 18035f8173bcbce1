"""The settings of one `wamrt train fit` run (`PolicyTrainer`), each with why it exists; saved in the
checkpoint's train_log and wamrt.json."""

from __future__ import annotations

from dataclasses import dataclass

NORMALIZATIONS = ("relative", "absolute", "none")


@dataclass
class TrainConfig:
    size: str = "policy-s"  # a registered wamrt.model config
    tier: str = "256"  # resolution tier of the DROID canvas bucket (written to wamrt.json)
    batch: int = 64
    lr: float = 3e-4
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    warmup: int = 200
    minutes: float = 5.0  # wall-clock budget of the optimisation loop
    max_steps: int | None = None
    ema: float = 0.999
    text_dropout: float = 0.1
    action_weight: float = 10.0
    sigma_shift: float = 5.0
    aug_shift_px: int = 6  # random translation of the whole canvas, pixels (0: off)
    aug_colour: float = 0.1  # brightness / contrast / per-channel gain jitter amplitude (0: off)
    # False: only frame 0 (the observation the policy conditions on) is augmented and VAE-encoded per step;
    # the future frames (the auxiliary vision target) come from a clean latent cache built once. One encode
    # per sample instead of 9: the per-step encode was what bounded training throughput.
    aug_future: bool = False
    seed: int = 0
    vae_seed: int = 7
    log_every: int = 50
    # Episodes held out of training (the last ones in file order): every log line then also reports the
    # action loss on a fixed batch of their frames, so a run that fails closed-loop says whether it
    # under-fitted or did not generalise.
    val_episodes: int = 0
    # DAgger episodes held out too, spread evenly over those recorded (file order), with their own fixed batch
    # (`val dagger` in the log). The last episodes in file order are expert demos in a DAgger round, which the
    # checkpoint it continues already fits: their loss cannot say whether the round learns its requests or
    # memorises them.
    val_dagger_episodes: int = 0
    # Save the EMA weights of the log step (or of the start) whose held-out loss was lowest -- the held-out DAgger
    # episodes' where there are any, else the held-out episodes' -- instead of the last ones. A DAgger round that
    # trains past that point memorises its requests: its held-out DAgger loss rises while the training loss falls
    # (bench/results/rollout/2026-12-08-32f71d4-dagger-round10-h100/).
    keep_best: bool = False
    val_batch: int = 128
    grad_clip: float = 1.0
    # How actions are presented to the model (stored in wamrt.json, undone by the served contract):
    # "relative": joints as offsets from the state row, every (chunk row, column) scaled by its training
    # statistics, the state row standardised; "absolute": the same statistics without the offset; "none": raw
    # radians, as the released DROID checkpoints take them.
    normalization: str = "relative"
    # True: one instruction per batch (and the unconditional prompt for a whole batch with probability
    # text_dropout), so the Generator attends to one prefix length without a key mask and the Reasoner runs
    # once per step. False: every sample draws its own instruction (a masked attention call per layer).
    prompt_batches: bool = True
    # Wall-clock minutes at which the EMA weights are also saved as complete checkpoints (out/snapshots/<m>min),
    # so success can be plotted against training time.
    snapshot_minutes: tuple[float, ...] = ()
    # A trained checkpoint to continue from (its weights, VAE and normalization statistics; a fresh optimiser
    # with warm-up), so training can span several GPU jobs.
    init_from: str | None = None
    # Random clean action prefixes (see train/trainer.py's docstring): the largest d drawn (0: off) and the share of
    # samples that get none. A checkpoint trained with them says so in wamrt.json (`trained_with_action_prefix`).
    prefix_max: int = 0
    prefix_zero_share: float = 0.25
    # Perturbed prefixes (`perturb_prefix`): the std of the joint offset, in normalized action units (0: the ground
    # truth), and over how many rows after the prefix the targets return from it (e-folding; 0: at once).
    prefix_noise: float = 0.0
    prefix_noise_rows: float = 4.0
    # DAgger frames (eval/dagger.py) are drawn this many times as often as an expert frame: an episode gives ~20
    # requests where a demo gives ~150 frames.
    dagger_repeat: int = 1
    # The same for DAgger frames without a prefix (recorded at d = 0, classic DAgger); None: dagger_repeat. The first
    # round's d = 0 cell gained 26 points and its d = 10 cell 4 (bench/results/rollout/2026-12-06-945d6c9-dagger-
    # round-h100/): this weights the delayed frames over them.
    dagger_d0_repeat: int | None = None
    # DAgger frames whose reply's gripper disagreed with the label over the rows the arm ran (`gripper_disagrees`; not
    # those marked grasp_unseen) are drawn this many times as often again. On the turntable at d = 10, round 9 closed
    # where the label waited for the moving cube in 29 of its 33 gripper disagreements
    # (bench/results/rollout/2026-12-07-88b8009-turntable-d10-gripper-cpu/).
    dagger_disagree_repeat: int = 1
    # The seam: the first `seam_rows` generated rows after a prefix (d > 0), what the arm runs first when it leaves the
    # committed rows for a new plan, weigh `seam_weight` times as much in the action loss (1: no weighting). After the
    # first DAgger round these rows were the ones that did not get closer to the expert at d = 10
    # (bench/results/rollout/2026-12-06-560a357-dagger-gap-round1-cpu/).
    seam_weight: float = 1.0
    seam_rows: int = 4
    # The gripper column weighs this much more in the action loss than a joint column (1: no weighting). On the
    # turntable at d = 10, 29 of 33 gripper disagreements between round 9 and its labels closed the gripper where the
    # label waited for the moving cube (bench/results/rollout/2026-12-07-88b8009-turntable-d10-gripper-cpu/).
    gripper_loss_weight: float = 1.0
    # DAgger chunks marked `grasp_unseen` (eval/dagger.py: the label opens the gripper for a grasp that fails after
    # the request's view) leave their gripper column after the prefix out of the action loss; False: learnt as labelled.
    mask_unseen_grasps: bool = True
