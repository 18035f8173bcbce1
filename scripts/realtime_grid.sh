#!/usr/bin/env bash
# Issue 41: the strategy x delay grid on the H200 (`wamrt eval grid`, docs/realtime.md), then optionally the
# wall-clock check (a 15 Hz client against a real server). Run by `scripts/gpu_run.sh grid[:SECONDS]` after
# `prefix-train` in the same call (its checkpoint stays at /tmp/wamrt-prefix/ckpt), or on its own:
#   RES=/tmp/res OUT=/tmp/out bash scripts/realtime_grid.sh [TRAINED_CHECKPOINT_FOLDER]
# Carry .whl (mujoco + the server wheels) and .gl (EGL), as for scripts/gpu_pipeline.sh.
#
# Grid: panda-droid (POLICY) for sync / async / blend / prefix-inpaint, the prefix-trained checkpoint (argument 1, else
# TRAINED, else /tmp/wamrt-prefix/ckpt; a folder or a name such as panda-droid-rt; left out if absent) for prefix-trained, d in DELAYS, on TASKS, EPISODES
# paired seeds per cell. In one process: the policies on the GPU (fast engine, CUDA graphs captured at MAX_BATCH), WORKERS
# simulator processes x LANES episodes each, rendering only at request steps. Within a task d = 0 and d = 10 run first;
# BUDGET_S stops new episodes (a cut cell is written with `complete: false`). The cells live in GRID_DIR
# (/tmp/wamrt-grid): a second call on the warm machine runs only the cells not yet complete. Writes $RES/grid/ (a
# rollout file per cell, summary.md, summary.json, success-vs-delay.png, per task) and $RES/grid-<phase>.txt.
#
# WALL=1 (GRID=0: alone; `scripts/gpu_run.sh grid-wall`) then serves the prefix-trained checkpoint (else POLICY) with --added-latency-ms WALL_ADDED_MS (default 560: with
# the model's own time d ~ 10 at 15 Hz) and runs WALL_EPISODES turntable episodes per strategy in WALL_STRATEGIES with
# the real-time client (--wall-clock, WALL_LANES lane processes): $RES/wall-<strategy>.json, to compare with the grid's
# deterministic cell at the measured d.
#
# Knobs (env): POLICY TRAINED TRAINED_TASKS TASKS PHASES DELAYS STRATEGIES EPISODES WORKERS LANES MAX_BATCH BUDGET_S GRID_ARGS GRID_DIR WALL
#   WALL_ADDED_MS WALL_EPISODES WALL_LANES WALL_STRATEGIES WALL_S PY SKIP_INSTALL=1 (local: no .gl unpacking).
# CPU dry run (2 cells, 2 episodes, 12 steps, the expert planner needs no GPU; POLICY=tiny-droid exercises the
# batched policy path instead, slowly):
#   SKIP_INSTALL=1 PY=/work/main/.venv/bin/python RES=/tmp/grid-res POLICY=expert TASKS=turntable DELAYS=0,10 \
#   STRATEGIES=async,prefix EPISODES=2 WORKERS=1 LANES=2 GRID_ARGS="--max-steps 12" bash scripts/realtime_grid.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:?set RES (the part folder)}
# shellcheck source=scripts/gpu_lib.sh
source scripts/gpu_lib.sh
part_start || exit 1
export PYTHONPATH=${PYTHONPATH:-$PWD/src}

POLICY=${POLICY:-src/wamrt/assets/panda-droid}
TRAINED=$(carried_ckpt "${1:-${TRAINED:-/tmp/wamrt-prefix/ckpt}}")  # a .tgz carried in .ckpt-carry/ too
TASKS=${TASKS:-turntable,pick_place}
DELAYS=${DELAYS:-0,1,3,6,10,14}
STRATEGIES=${STRATEGIES:-sync,async,blend,prefix-inpaint,prefix-trained,prefix-trained-seam}
EPISODES=${EPISODES:-200}
WORKERS=${WORKERS:-15}
LANES=${LANES:-16}
MAX_BATCH=${MAX_BATCH:-128}
BUDGET_S=${BUDGET_S:-330}
# The episodes in flight at BUDGET_S run on (up to ~50 s at 15 x 16 lanes), then the summary is written: a part killed
# before that returns none of its cells (0230412: grid:390 with BUDGET_S=330 came back empty). GRID_LIMIT_S (the
# part's seconds, set by gpu_run.sh) caps the budget at 100 s below it.
if [ -n "${GRID_LIMIT_S:-}" ] && [ "$BUDGET_S" -gt $(( GRID_LIMIT_S - 100 )) ]; then
  log "BUDGET_S $BUDGET_S leaves the part (${GRID_LIMIT_S} s) no time to finish its episodes: $(( GRID_LIMIT_S - 100 )) s"
  BUDGET_S=$(( GRID_LIMIT_S - 100 ))
fi
GRID_ARGS=${GRID_ARGS:-}
# Outside the part's folder (gpu_run.sh empties that per call): a later call on the warm machine resumes the grid,
# running only the cells not yet complete (--resume).
GRID_DIR=${GRID_DIR:-/tmp/wamrt-grid}
trained_ok() {  # a checkpoint folder, or a trained model name whose folder is present (e.g. panda-droid-rt)
  [ -d "$1" ] || "$PY" -c "import sys; from wamrt.pipeline.policy import trained_path; trained_path(sys.argv[1])" \
    "$1" >/dev/null 2>&1
}
if [ "$POLICY" != expert ] && ! trained_ok "$TRAINED"; then
  log "no prefix-trained checkpoint at $TRAINED: the prefix-trained cells are left out"
  TRAINED=
fi
[ "$POLICY" = expert ] && TRAINED=

if [ "${GRID:-1}" = 1 ]; then
  # A task the base policy never saw (TRAINED_TASKS, default the moving turntable: panda-droid was trained on
  # pick_place only) runs every strategy on the prefix-trained checkpoint; prefix-inpaint then means that checkpoint
  # with action_prefix_mode=inpaint. Each task is its own grid (GRID_DIR/<task>), run in PHASES: TASK or TASK:DELAYS
  # (d separated by '/'), each a `wamrt eval grid --resume` on what is left of BUDGET_S. The default runs the
  # d = 0 cells of pick_place first (the prefix-trained checkpoint's synchronous score, bar >= 85 %), then the
  # turntable grid (the bars at d = 10), then the rest of pick_place; a later call resumes where this one stopped.
  first=; case ",$TASKS," in *,pick_place,*) first="pick_place:0 " ;; esac
  PHASES=${PHASES:-$first${TASKS//,/ }}
  grid_t0=$(date +%s)
  rm -rf "$RES/grid"; mkdir -p "$RES/grid"
  for phase in $PHASES; do
    task=${phase%%:*}; delays=$DELAYS
    phase_name=${phase//[:\/]/-}  # turntable:0/10 -> grid-turntable-0-10.txt (no ':' in committed file names)
    [ "$task" != "$phase" ] && delays=${phase#*:} && delays=${delays//\//,}
    left=$(( BUDGET_S - ($(date +%s) - grid_t0) ))
    if [ "$left" -lt 30 ]; then log "grid $phase: skipped, ${left} s of BUDGET_S left"; continue; fi
    pol=$POLICY
    case ",${TRAINED_TASKS-turntable}," in *",$task,"*) [ -n "$TRAINED" ] && pol=$TRAINED ;; esac
    log "grid $task: $pol${TRAINED:+ + $TRAINED (prefix-trained)}, d $delays, $STRATEGIES, $EPISODES episodes, $WORKERS workers x $LANES lanes, batch $MAX_BATCH, budget $left s"
    # shellcheck disable=SC2086
    "$PY" -m wamrt.cli eval grid --policy "$pol" ${TRAINED:+--trained-policy "$TRAINED"} --tasks "$task" \
      --delays "$delays" --strategies "$STRATEGIES" --episodes "$EPISODES" --workers "$WORKERS" --lanes "$LANES" \
      --max-batch "$MAX_BATCH" --budget-s "$left" --out "$GRID_DIR/$task" --resume $GRID_ARGS 2>&1 \
      | grep --line-buffered -v Warning | tee "$RES/grid-$phase_name.txt"
    rm -rf "$RES/grid/$task"; cp -r "$GRID_DIR/$task" "$RES/grid/$task"
    log "grid $phase done: $(tail -1 "$RES/grid-$phase_name.txt")"
  done
fi

if [ "${WALL:-0}" = 1 ]; then
  WALL_POLICY=${TRAINED:-$POLICY}
  WALL_ADDED_MS=${WALL_ADDED_MS:-560}
  WALL_EPISODES=${WALL_EPISODES:-200}
  WALL_LANES=${WALL_LANES:-16}
  WALL_S=${WALL_S:-240}
  SERVE_ARGS="--added-latency-ms $WALL_ADDED_MS" serve_start wall "$WALL_POLICY" 8810 "$WALL_LANES" || exit 1
  for s in ${WALL_STRATEGIES:-prefix async}; do
    log "wall clock: $s, $WALL_EPISODES turntable episodes x $WALL_LANES lanes at 15 Hz, server +$WALL_ADDED_MS ms"
    timeout "$WALL_S" "$PY" -m wamrt.cli rollout --url ws://127.0.0.1:8810 --task turntable --episodes "$WALL_EPISODES" \
      --lanes "$WALL_LANES" --seed0 0 --wall-clock --strategy "$s" --out "$RES/wall-$s.json" > "$RES/wall-$s.txt" 2>&1
    log "wall $s: $(grep -E '^turntable|^delay mode' "$RES/wall-$s.txt" | tr '\n' ' ')"
  done
  serve_stop wall
fi
