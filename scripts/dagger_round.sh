#!/usr/bin/env bash
# Issue 41: one DAgger round on the robot's clock (docs/train.md, "Training on the policy's own prefixes"). Run by
# `scripts/gpu_run.sh dagger[:SECONDS]`; carry .whl and .gl. INIT, the checkpoint to continue: default the embedded
# panda-droid-rt; a .tgz a call returned is unpacked with panda-droid's VAE.
#
# 1. From t = 0 for REC_S seconds, side by side on the host's cores:
#    - `wamrt eval grid --record-dagger`: INIT drives DAGGER_EPISODES episodes per cell on the GPU (prefix-trained,
#      d in DAGGER_DELAYS, seeds DAGGER_SEED0..), every request written with the scripted expert's chunk for it; one grid
#      process per task in DAGGER_TASKS, side by side, sharing DAGGER_WORKERS simulator processes;
#    - DART expert demos of each task (seeds DEMO_SEED0.., DEMO_WORKERS processes per task), so the round keeps seeing the
#      expert's own states and future frames.
# 2. `wamrt train fit` from INIT on both for MINUTES, the DAgger frames drawn DAGGER_REPEAT times as often (those
#    recorded at d = 0: DAGGER_D0_REPEAT), with the recipe of the perturbed-prefix round (prefix d 0..14, noise 0.5
#    on the demos' prefixes).
# Writes $RES/{summary.txt, dagger-grid-<task>.txt, dagger-grid/<task>/ (the cells: INIT's own score on those seeds),
#   demos-*.txt, train.txt, train_log.txt, ckpt-wamrt.json} and $OUT/prefix-ckpt.tgz; the checkpoint stays at $CKPT
#   (/tmp/wamrt-prefix/ckpt) for a `grid` call on the warm machine.
# ROUND_PHASE=record stops after step 1 and leaves the recordings in $PREFIX_WORK; ROUND_PHASE=train (the next call,
# on the same warm machine) runs step 2 on them.
# The defaults spend a call on recording: round 10's held-out DAgger loss was lowest ~200 steps into its 4.5 minutes
# of training and rose after (its ~6,500 requests memorised), so a round trains 1.5 minutes and keeps the EMA
# weights of its best held-out step (`--keep-best`), and records for 300 s.
# Timing (H100): REC_S=150 took 224 s of recording (the episodes in flight at the budget run to their end; 32f71d4),
# and training costs ~35 s of loading and saving per ~36,000 frames beside MINUTES: give the part REC_S + 60 *
# MINUTES + 180 s (the defaults: dagger:580).
# CPU dry run (tiny, a minute):
#   SKIP_INSTALL=1 PY=/work/main/.venv/bin/python RES=/tmp/dg-res OUT=/tmp/dg-out INIT=src/wamrt/assets/panda-droid \
#   DAGGER_TASKS=pick_place,turntable DAGGER_DELAYS=3 DAGGER_EPISODES=2 DAGGER_WORKERS=1 DEMO_WORKERS=1 REC_S=40 MINUTES=0.1 \
#   BATCH=4 GRID_ARGS="--max-steps 24 --lanes 2 --max-batch 4" bash scripts/dagger_round.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:?set RES (the part folder)}
WORK=${PREFIX_WORK:-/tmp/wamrt-prefix}
CKPT=${CKPT:-$WORK/ckpt}
mkdir -p "$WORK"
# shellcheck source=scripts/gpu_lib.sh
source scripts/gpu_lib.sh
part_start || exit 1
export PYTHONPATH=${PYTHONPATH:-$PWD/src}

INIT=$(carried_ckpt "${INIT:-src/wamrt/assets/panda-droid-rt}") || { log "FATAL: cannot unpack INIT"; exit 1; }
DAGGER_TASKS=${DAGGER_TASKS:-turntable,pick_place}
DAGGER_DELAYS=${DAGGER_DELAYS:-10,6,14}  # delayed requests only: d = 0 is what the demos teach
DAGGER_EPISODES=${DAGGER_EPISODES:-400}  # a cap per cell; REC_S is what ends the recording
DAGGER_WORKERS=${DAGGER_WORKERS:-10}
DEMO_WORKERS=${DEMO_WORKERS:-2}
DAGGER_REPEAT=${DAGGER_REPEAT:-4}
DAGGER_D0_REPEAT=${DAGGER_D0_REPEAT:-$DAGGER_REPEAT}  # the frames recorded at d = 0 (no prefix)
SEAM_WEIGHT=${SEAM_WEIGHT:-1}  # `train fit --seam-weight`: the first 4 rows after a prefix weigh this much more
REC_S=${REC_S:-300}
MINUTES=${MINUTES:-1.5}
BATCH=${BATCH:-128}
LR=${LR:-1e-4}
GRID_ARGS=${GRID_ARGS:---lanes 16 --max-batch 128}
TRAIN_ARGS=${TRAIN_ARGS---keep-best --log-every 50}  # TRAIN_ARGS= (empty): the last EMA weights
VAL_DAGGER=${VAL_DAGGER:-12}  # DAgger episodes held out (`train fit --val-dagger-episodes`: "val dagger" in the log)
ROUND_PHASE=${ROUND_PHASE:-all}
case $ROUND_PHASE in all|record|train) ;; *) log "FATAL: ROUND_PHASE must be all, record or train: $ROUND_PHASE"; exit 1 ;; esac
# Every round records other layouts. Until 2026-12-07 each round recorded seeds 800000.. and 900000.., so every round
# saw the same 60 layouts a cell and the same demo seeds. On those trained-on seeds round 5 scored 90 % on
# pick_place at d = 10, against 59.5 % on the gate's seeds 0-199 (bench/results/rollout/2026-12-07-476dde2-*/).
# The block is a function of INIT's weights: a round is reproducible, and the next round (another INIT) moves on.
# DAgger seeds stay in 800000-899999, DART demos in 1000000-1299999: clear of the gates' 0-199, the held-out
# 950000.. and the earlier recordings' ranges.
round_key=$("$PY" - "$INIT" <<'PYEOF'
import hashlib, pathlib, sys
weights = pathlib.Path(sys.argv[1]) / "transformer" / "diffusion_pytorch_model.safetensors"
digest = hashlib.sha256(weights.read_bytes() if weights.is_file() else sys.argv[1].encode()).hexdigest()
print(int(digest[:8], 16) % 1000)
PYEOF
) || { log "FATAL: cannot read INIT $INIT"; exit 1; }
DAGGER_SEED0=${DAGGER_SEED0:-$(( 800000 + round_key * 100 ))}
DEMO_SEED0=${DEMO_SEED0:-$(( 1000000 + round_key * 300 ))}
tasks=(${DAGGER_TASKS//,/ })
dirs=("$WORK/dagger")
for t in "${tasks[@]}"; do dirs+=("$WORK/demos-dart-$t"); done
# Step 1: the recordings, in $WORK/dagger and $WORK/demos-dart-<task>.
record_round() {
  rm -rf "$WORK/dagger" "$WORK/dagger-grid" "$WORK"/demos-dart-*
  log "dagger round: init $INIT; recording $REC_S s: $DAGGER_EPISODES episodes per cell of $DAGGER_TASKS at d $DAGGER_DELAYS ($DAGGER_WORKERS workers, seeds $DAGGER_SEED0..) + DART demos ($DEMO_WORKERS workers a task, seeds $DEMO_SEED0..)"

  # One grid process per task, side by side, each with the whole budget and its share of DAGGER_WORKERS: a single grid
  # runs one task's cells before the other's, and in 945d6c9's round the budget ran out after 183 turntable episodes
  # and 2 of pick_place (bench/results/rollout/2026-12-06-945d6c9-dagger-round-h100/).
  task_workers=$(( DAGGER_WORKERS / ${#tasks[@]} > 0 ? DAGGER_WORKERS / ${#tasks[@]} : 1 ))
  grid_pids=() demo_pids=()
  for t in "${tasks[@]}"; do
    # shellcheck disable=SC2086
    "$PY" -m wamrt.cli eval grid --policy "$INIT" --trained-policy "$INIT" --tasks "$t" \
      --delays "$DAGGER_DELAYS" --strategies prefix-trained --episodes "$DAGGER_EPISODES" --seed0 "$DAGGER_SEED0" \
      --workers "$task_workers" --budget-s "$REC_S" --record-dagger "$WORK/dagger" --out "$WORK/dagger-grid/$t" \
      $GRID_ARGS > "$RES/dagger-grid-$t.txt" 2>&1 &
    grid_pids+=($!)
  done
  for t in "${tasks[@]}"; do
    d=$WORK/demos-dart-$t
    "$PY" -m wamrt.cli train record --task "$t" --episodes 2000 --seed0 "$DEMO_SEED0" --workers "$DEMO_WORKERS" \
      --seconds "$REC_S" --action-noise 0.02 --out "$d" > "$RES/demos-$t.txt" 2>&1 &
    demo_pids+=($!)
  done
  wait "${demo_pids[@]}" "${grid_pids[@]}"
  cp -r "$WORK/dagger-grid" "$RES/dagger-grid" 2>/dev/null
  log "recorded DAgger episodes: $(for t in "${tasks[@]}"; do echo -n "$t $(ls "$WORK/dagger"/dagger-"$t"-*.npz 2>/dev/null | wc -l) "; done)(grids' last lines: $(for t in "${tasks[@]}"; do grep -v Warning "$RES/dagger-grid-$t.txt" | tail -1 | cut -c1-100 | tr -d "\n"; echo -n "; "; done)); demos: $(for t in "${tasks[@]}"; do echo -n "$t $(ls "$WORK/demos-dart-$t"/*.npz 2>/dev/null | wc -l) "; done)"
  [ -n "$(ls "$WORK/dagger"/*.npz 2>/dev/null)" ] || { log "FATAL: no DAgger episodes"; tail -5 "$RES"/dagger-grid-*.txt; return 1; }
}
[ "$ROUND_PHASE" = train ] || record_round || exit 1
if [ "$ROUND_PHASE" = record ]; then
  log "recorded in $(( $(date +%s) - T0 )) s; ROUND_PHASE=train on this machine trains on them"; exit 0
fi
[ -n "$(ls "$WORK/dagger"/*.npz 2>/dev/null)" ] || { log "FATAL: no DAgger episodes in $WORK/dagger (ROUND_PHASE=record first, on this machine)"; exit 1; }

n=0; for d in "${dirs[@]}"; do n=$(( n + $(ls "$d"/*.npz 2>/dev/null | wc -l) )); done
val=$(( n / 10 < 10 ? n / 10 : 10 ))  # the last episodes in path order: the last task's DART demos (expert frames)
n_dagger=$(ls "$WORK/dagger"/*.npz | wc -l)
val_dagger=$(( n_dagger / 4 < VAL_DAGGER ? n_dagger / 4 : VAL_DAGGER ))
log "train: $MINUTES min from $INIT on $n episodes ($val + $val_dagger DAgger held out), DAgger frames x$DAGGER_REPEAT (at d = 0 x$DAGGER_D0_REPEAT), batch $BATCH, lr $LR"
# shellcheck disable=SC2086
timeout "$("$PY" -c "print(int($MINUTES * 60 + 200))")" "$PY" -m wamrt.cli train fit --demos "${dirs[@]}" \
  --out "$WORK/ckpt-dagger" --minutes "$MINUTES" --batch "$BATCH" --lr "$LR" --warmup 50 --val-episodes "$val" \
  --val-dagger-episodes "$val_dagger" \
  --aug-shift 0 --aug-colour 0 --log-every 100 --init-from "$INIT" --prefix-max 14 --prefix-zero-share 0.25 \
  --prefix-noise 0.5 --prefix-noise-rows 4 --dagger-repeat "$DAGGER_REPEAT" --dagger-d0-repeat "$DAGGER_D0_REPEAT" \
  --seam-weight "$SEAM_WEIGHT" $TRAIN_ARGS > "$RES/train.txt" 2>&1
cp "$WORK/ckpt-dagger/train_log.txt" "$RES/train_log.txt" 2>/dev/null
log "train: $(grep '^done' "$RES/train.txt" | head -1); last: $(grep '^step' "$RES/train.txt" | tail -1 | cut -c1-190)"
[ -f "$WORK/ckpt-dagger/wamrt.json" ] || { log "FATAL: no checkpoint: $(grep -v Warning "$RES/train.txt" | tail -3)"; exit 1; }
rm -rf "$CKPT"; mv "$WORK/ckpt-dagger" "$CKPT"
cp "$CKPT/wamrt.json" "$RES/ckpt-wamrt.json"
tar czf "$OUT/prefix-ckpt.tgz" -C "$CKPT" --exclude=snapshots --exclude=vae transformer tokenizer wamrt.json train_log.txt
log "dagger round done in $(( $(date +%s) - T0 )) s; checkpoint at $CKPT, $(du -b "$OUT/prefix-ckpt.tgz" | cut -f1) bytes in prefix-ckpt.tgz (no vae: panda-droid's)"
