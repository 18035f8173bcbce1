"""`wamrt train record` (expert demos as policy canvases) and `wamrt train fit` (flow-matching training).

Heavy imports (mujoco, torch) happen inside the command functions so `wamrt --help` stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train", help="train a small policy of our architecture on simulator demos")
    tsub = tr.add_subparsers(dest="train", required=True)
    rec = tsub.add_parser("record", help="scripted-expert episodes stored as the policy's padded canvases")
    rec.add_argument("--task", default="pick_place", help="lift, pick_place or pick_place_two")
    rec.add_argument("--episodes", type=int, default=100, help="expert episodes to record")
    rec.add_argument("--seed0", type=int, default=100_000, help="seeds seed0.. (keep clear of eval seeds 0..)")
    rec.add_argument("--workers", type=int, default=1, help="simulator processes")
    rec.add_argument("--tier", default="256", help="resolution tier of the DROID canvas")
    rec.add_argument("--seconds", type=float, help="stop handing out episodes after this many seconds")
    rec.add_argument("--action-noise", type=float, default=0.0, metavar="RAD",
                     help="DART: smooth noise of this std on the executed joint targets; the recorded actions "
                          "stay the expert's, so the demos show recoveries (default 0: off)")
    rec.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the recorded demos")
    rec.set_defaults(func=run_record)

    fit = tsub.add_parser("fit", help="flow-matching training -> checkpoint folder loadable by load_policy")
    fit.add_argument("--demos", type=Path, nargs="+", required=True, metavar="DIR",
                     help="folders written by `wamrt train record`")
    fit.add_argument("--out", type=Path, required=True, metavar="DIR", help="checkpoint folder to write")
    fit.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget of the training loop")
    fit.add_argument("--max-steps", type=int, help="optimizer step limit (default: only --minutes)")
    fit.add_argument("--size", default="policy-s", help="a registered wamrt.model config")
    fit.add_argument("--tier", default="256", help="resolution tier (must match the demos')")
    fit.add_argument("--batch", type=int, default=64, help="samples per optimizer step")
    fit.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    fit.add_argument("--warmup", type=int, default=200, help="learning-rate warm-up steps")
    fit.add_argument("--ema", type=float, default=0.999, help="decay of the weights' exponential moving average")
    fit.add_argument("--text-dropout", type=float, default=0.1,
                     help="probability of the unconditional prompt (trains the CFG branch)")
    fit.add_argument("--action-weight", type=float, default=10.0, help="action loss weight against the video loss")
    fit.add_argument("--sigma-shift", type=float, default=5.0, help="shift of the training noise-level distribution")
    fit.add_argument("--aug-shift", type=int, default=6, help="random canvas shift, pixels (0: off)")
    fit.add_argument("--aug-colour", type=float, default=0.1, help="colour jitter amplitude (0: off)")
    fit.add_argument("--aug-future", action="store_true",
                     help="augment and re-encode the future frames too (9 VAE encodes per sample instead of 1)")
    fit.add_argument("--val-episodes", type=int, default=0,
                     help="hold out the last N episodes; the log then reports their action loss")
    fit.add_argument("--val-dagger-episodes", type=int, default=0,
                     help="also hold out N DAgger episodes spread over those recorded; the log reports their action "
                          "loss as 'val dagger'")
    fit.add_argument("--keep-best", action="store_true",
                     help="save the EMA weights of the log step (or the start) with the lowest held-out loss -- the "
                          "held-out DAgger episodes' where there are any -- instead of the last (needs --val-episodes "
                          "or --val-dagger-episodes)")
    fit.add_argument("--normalization", choices=("relative", "absolute", "none"), default="relative",
                     help="action presentation stored in wamrt.json: joints relative to the state with per-row "
                          "statistics (default), the statistics alone, or raw radians")
    fit.add_argument("--mixed-prompts", action="store_true",
                     help="every sample draws its own instruction (masked attention) instead of one per batch")
    fit.add_argument("--snapshot-minutes", type=float, nargs="*", default=(),
                     help="also save the EMA weights as complete checkpoints at these wall-clock minutes "
                          "(OUT/snapshots/<m>min)")
    fit.add_argument("--init-from", metavar="CKPT",
                     help="continue a trained checkpoint (its weights, VAE and normalization; fresh optimiser)")
    fit.add_argument("--prefix-max", type=int, default=0, metavar="D",
                     help="training-time real-time chunking: per sample, the first d in 0..D chunk rows stay clean "
                          "(ground truth) and out of the loss, as a served `action_prefix` packs them; the "
                          "checkpoint then reads prefixes as clean rows (default 0: off; at most 16)")
    fit.add_argument("--prefix-zero-share", type=float, default=0.25, metavar="P",
                     help="share of samples with no prefix when --prefix-max is on (default 0.25)")
    fit.add_argument("--prefix-noise", type=float, default=0.0, metavar="S",
                     help="with --prefix-max: the prefix rows are the ground truth off by a random joint offset of "
                          "std S (normalized action units; 0.5 is about a policy's own open-loop error) and the "
                          "rows after them return from it, so the checkpoint learns to correct committed rows that "
                          "are off rather than continue them (default 0: the ground truth)")
    fit.add_argument("--prefix-noise-rows", type=float, default=4.0, metavar="K",
                     help="rows over which the targets return from that offset (e-folding; 0: at once)")
    fit.add_argument("--dagger-repeat", type=int, default=1, metavar="K",
                     help="draw the on-policy frames of `wamrt eval grid --record-dagger` folders K times as often "
                          "as an expert demo's frames (default 1)")
    fit.add_argument("--dagger-d0-repeat", type=int, metavar="K0",
                     help="the same for DAgger frames recorded without a prefix (d = 0); default: --dagger-repeat")
    fit.add_argument("--seam-weight", type=float, default=1.0, metavar="W",
                     help="weigh the first --seam-rows generated rows after a prefix W times as much in the action "
                          "loss (the rows the arm runs first after its committed ones; default 1)")
    fit.add_argument("--dagger-disagree-repeat", type=int, default=1, metavar="K",
                     help="draw DAgger requests whose reply's gripper disagreed with the label's over the rows the "
                          "arm ran K times as often again (default 1)")
    fit.add_argument("--gripper-weight", type=float, default=1.0, metavar="W",
                     help="weigh the gripper column W times as much as a joint column in the action loss (default 1)")
    fit.add_argument("--seam-rows", type=int, default=4, metavar="N", help="rows that --seam-weight covers (default 4)")
    fit.add_argument("--learn-unseen-grasps", action="store_true",
                     help="learn the gripper of DAgger chunks marked grasp_unseen as labelled (default: left out of "
                          "the loss after the prefix; eval/dagger.py says why)")
    fit.add_argument("--seed", type=int, default=0, help="initialization and sampling seed")
    fit.add_argument("--log-every", type=int, default=50, help="optimizer steps between log lines")
    fit.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    fit.add_argument("--log", type=Path, help="log file (default OUT/train_log.txt)")
    fit.set_defaults(func=run_fit)


def run_record(args: argparse.Namespace) -> int:
    try:
        from .. import sim  # noqa: F401  selects MUJOCO_GL before mujoco loads
    except (ImportError, RuntimeError) as e:
        print(f"error: the simulator is unavailable: {e}", file=sys.stderr)
        return 2
    from ..train.data import record_canvas_demos

    if not (args.action_noise >= 0 and math.isfinite(args.action_noise)):
        print(f"error: --action-noise must be a finite number >= 0, got {args.action_noise}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    seeds = range(args.seed0, args.seed0 + args.episodes)
    metas = record_canvas_demos(args.task, seeds, args.out, tier=args.tier, workers=args.workers,
                                deadline_s=args.seconds, action_noise=args.action_noise)
    ok = [m for m in metas if m.get("file")]
    frames = sum(m["length"] for m in ok)
    stats = {"task": args.task, "attempted": len(metas), "written": len(ok),
             "expert_success": len(ok) / max(1, len(metas)), "frames": frames,
             "mean_length": frames / max(1, len(ok)), "seconds": round(time.perf_counter() - t0, 1),
             "tier": args.tier, "action_noise": args.action_noise}
    (Path(args.out) / f"stats_{args.task}.json").write_text(json.dumps(stats, indent=1))
    print(f"demos: {json.dumps(stats)}")
    return 0 if ok else 1


def run_fit(args: argparse.Namespace) -> int:
    from ..train.data import load_demo_dirs
    from ..train.trainer import PolicyTrainer, TrainConfig

    try:
        ds = load_demo_dirs(args.demos)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = TrainConfig(size=args.size, tier=args.tier, batch=args.batch, lr=args.lr, warmup=args.warmup,
                      minutes=args.minutes, max_steps=args.max_steps, ema=args.ema, text_dropout=args.text_dropout,
                      action_weight=args.action_weight, sigma_shift=args.sigma_shift, aug_shift_px=args.aug_shift,
                      aug_colour=args.aug_colour, aug_future=args.aug_future, val_episodes=args.val_episodes,
                      val_dagger_episodes=args.val_dagger_episodes, keep_best=args.keep_best,
                      seed=args.seed, log_every=args.log_every, normalization=args.normalization,
                      prompt_batches=not args.mixed_prompts, snapshot_minutes=tuple(args.snapshot_minutes),
                      init_from=str(args.init_from) if args.init_from else None, prefix_max=args.prefix_max,
                      prefix_zero_share=args.prefix_zero_share, prefix_noise=args.prefix_noise,
                      prefix_noise_rows=args.prefix_noise_rows, dagger_repeat=args.dagger_repeat,
                      dagger_d0_repeat=args.dagger_d0_repeat, seam_weight=args.seam_weight,
                      gripper_loss_weight=args.gripper_weight, dagger_disagree_repeat=args.dagger_disagree_repeat,
                      mask_unseen_grasps=not args.learn_unseen_grasps,
                      seam_rows=args.seam_rows)
    try:
        trainer = PolicyTrainer(cfg, ds, args.out, device=args.device, log_path=args.log)
    except ValueError as e:  # tier mismatch, held-out count, prefix range
        print(f"error: {e}", file=sys.stderr)
        return 2
    if trainer.uses_latent_cache:
        trainer.cache_latents()
    trainer.train()
    out = trainer.save({"command": " ".join(sys.argv)})
    print(f"wrote {out}")
    return 0
