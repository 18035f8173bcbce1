#!/usr/bin/env bash
# Issue 41: the lossy levers re-gated on the robot's clock. Run by `scripts/gpu_run.sh lever-gates[:SECONDS]` (RES =
# the part's folder), after `prefix-train` in the same call (its checkpoint at /tmp/wamrt-prefix/ckpt) or on any
# CKPT. For each size and task: one baseline rollout of bf16 4 steps at that size's own d, then one paired gate per
# lever at the lever's own d (`python -m wamrt.eval.levers`: d = ceil(H200 p50 / 66.7 ms) from committed result
# files), the same strategy on both sides. Servers: the checkpoint in bf16 and quantized with gen-fp8, isolated
# requests (replayable), 16 lanes. Uses the delay mode of `wamrt rollout` / `wamrt eval gate` (docs/realtime.md):
# the baseline rollout runs with --delay-steps/--strategy, each candidate SPEC carries its own delay_steps= and
# strategy= keys, and the recorded baseline file is paired with candidates at another d.
#
# 200 episodes a rollout take ~100-180 s on 16 lanes: all 24 (2 sizes x 2 tasks x 6 configurations) are ~50 min, so
# split them over calls with SIZES, TASKS and LEVERS (names from wamrt.eval.levers; the baseline "bf16" runs first
# whatever LEVERS says).
# Knobs: CKPT (/tmp/wamrt-prefix/ckpt, else src/wamrt/assets/panda-droid), SIZES ("edge nano"), TASKS (default:
#   pick_place and the moving task(s), as prefix_train.sh), LEVERS (all), STRATEGY (prefix; its action_prefix_mode
#   is the checkpoint's auto: clean for a prefix-trained one), EPISODES (200), LANES (16), ROLL_S (240 a rollout or
#   gate), ROLL_ARGS, PY, SKIP_INSTALL=1.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:?set RES (the part folder)}
PY=${PY:-python3}
T0=$(date +%s)
export T0 RES
mkdir -p "$RES"
# shellcheck source=scripts/gpu_lib.sh
source scripts/gpu_lib.sh
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  for f in .gl/*.deb; do dpkg -x "$f" / || log "warning: dpkg -x $f failed"; done
  ldconfig 2>/dev/null || true
fi
choose_gl || exit 1
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
CKPT=${CKPT:-/tmp/wamrt-prefix/ckpt}
[ -f "$CKPT/wamrt.json" ] || CKPT=src/wamrt/assets/panda-droid
SIZES=${SIZES:-"edge nano"}
TASKS=${TASKS:-$("$PY" -c "from wamrt.sim.tasks import TASKS
print(' '.join(['pick_place'] + [t for t in TASKS if t not in ('lift', 'pick_place', 'pick_place_two')]))")}
STRATEGY=${STRATEGY:-prefix}
EPISODES=${EPISODES:-200}
LANES=${LANES:-16}
ROLL_S=${ROLL_S:-240}
ROLL_ARGS=${ROLL_ARGS:-}
"$PY" -m wamrt.eval.levers > "$RES/levers.tsv" || { log "FATAL: no lever table"; exit 1; }
LEVERS=${LEVERS:-$(cut -f2 "$RES/levers.tsv" | sort -u | grep -v '^bf16$' | tr '\n' ' ')}
log "lever-gates: $CKPT, sizes [$SIZES], tasks [$TASKS], levers [$LEVERS], $EPISODES episodes x $LANES lanes, strategy $STRATEGY"

BATCH_INVARIANT=1 serve_launch bf16 "$CKPT" 8801 "$LANES"
if grep -qP '\tgen-fp8\t' "$RES/levers.tsv"; then
  "$PY" -m wamrt.cli quantize --model "$CKPT" --recipe gen-fp8 --out /tmp/wamrt-levers-fp8 > "$RES/quantize.txt" 2>&1 \
    && BATCH_INVARIANT=1 serve_launch fp8 /tmp/wamrt-levers-fp8 8802 "$LANES"
fi
serve_ready bf16 || exit 1

for size in $SIZES; do
  base_d=$(awk -F'\t' -v s="$size" '$1 == s && $2 == "bf16" {print $3}' "$RES/levers.tsv")
  for task in $TASKS; do
    base=$RES/rollout-$size-bf16-$task-d$base_d.json
    log "baseline $size bf16 (d $base_d) on $task"
    # shellcheck disable=SC2086
    timeout "$ROLL_S" "$PY" -m wamrt.cli rollout --url ws://127.0.0.1:8801 --task "$task" --episodes "$EPISODES" \
      --lanes "$LANES" --seed0 0 --delay-steps "$base_d" --strategy "$STRATEGY" --out "$base" $ROLL_ARGS \
      > "${base%.json}.txt" 2>&1
    log "  $(grep -E "^$task" "${base%.json}.txt" | head -1)"
    [ -f "$base" ] || { log "  no baseline: $(tail -n 2 "${base%.json}.txt" | tr '\n' ' ')"; continue; }
    while IFS=$'\t' read -r s name d ms spec recipe _; do
      [ "$s" = "$size" ] && [ "$name" != bf16 ] && [[ " $LEVERS " == *" $name "* ]] || continue
      [ "$spec" = - ] && spec=: || spec=$spec,
      spec=${spec}delay_steps=$d,strategy=$STRATEGY
      url=ws://127.0.0.1:8801
      if [ "$recipe" = gen-fp8 ]; then serve_ready fp8 || continue; url=ws://127.0.0.1:8802; fi
      out=$RES/gate-$size-$name-$task-d$d.json
      log "gate $size $name ($ms ms, d $d) on $task: $url$spec"
      # shellcheck disable=SC2086
      timeout "$ROLL_S" "$PY" -m wamrt.cli eval gate --task "$task" --episodes "$EPISODES" --lanes "$LANES" --seed0 0 \
        --baseline "$base" --candidate "$url$spec" --out "$out" $ROLL_ARGS \
        > "${out%.json}.txt" 2>&1
      grep -E "^(candidate|difference|verdict)" "${out%.json}.txt" | tr '\n' ' ' | sed 's/^/  /' | tee -a "$RES/summary.txt"
      echo | tee -a "$RES/summary.txt"
    done < "$RES/levers.tsv"
  done
done
serve_stop bf16; serve_stop fp8
log "lever-gates done in $(( $(date +%s) - T0 )) s"
