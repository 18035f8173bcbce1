#!/usr/bin/env bash
# The whole panda-droid run on the lent H200 as ONE background pipeline that outlives device calls:
# demos (recorded while phase A trains) -> training variants side by side, in phases -> a short closed-loop selection -> the 200-episode evaluation of
# the best one through `wamrt serve` -> paired gates (self, 1 step, 2 steps, CFG on the first step, gen-fp8)
# -> lift and two-cube rollouts. Each device call only starts or waits on it and copies what exists to $OUT.
#
#   bash scripts/gpu_pipeline.sh start   # call 1: install, start the pipeline (setsid), then wait
#   bash scripts/gpu_pipeline.sh wait    # later calls (within the machine's 30 s warm window)
#   EVAL_CKPT=src/wamrt/assets/panda-droid bash scripts/gpu_pipeline.sh start   # evaluation and gates only
#
# Carry .whl and .gl (see scripts/gpu_lib.sh). Seeds: demos 100000.. (train record default), selection
# 1000..1000+SEL_EPISODES, evaluation and its gates 0..EVAL_EPISODES-1: neither was trained on.
# Knobs (env): DEMOS DEMO_S WORKERS DART_NOISE PHASES PHASE_MIN_<p> INIT BATCH VARIANTS VARIANT_<v> DEMOS_<v>
#   TRAIN_ARGS SEL_EPISODES SEL_LANES EVAL_EPISODES LANES EVAL_S GATES GATE_S BATCH_INVARIANT OTHER_TASKS
#   OTHER_EPISODES ROLL_ARGS WAIT_S THEN
#   PY (absolute) SKIP_INSTALL=1 (local test: the current env) WORK OUT. A local smoke test of the whole flow on a CPU:
#   SKIP_INSTALL=1 PY=$PWD/.venv/bin/python DEMOS=3 DEMO_S=20 WORKERS=1 PHASE_MIN_A=0.2 PHASE_MIN_B=0.2 BATCH=4 \
#   INIT= TRAIN_ARGS="--size tiny-qwen" SEL_EPISODES=2 SEL_LANES=2 EVAL_EPISODES=2 LANES=2 OTHER_EPISODES=1 \
#   ROLL_ARGS="--max-steps 16" bash scripts/gpu_pipeline.sh start
# $OUT gets: summary.txt, results.tgz (every rollout / gate JSON, logs, train logs), checkpoint-<v>.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export REPO=${REPO:-$PWD}  # the tree the device calls send (the pipeline itself runs from a snapshot of it)
T0=${T0:-$(date +%s)}
export T0
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
WORK=${WORK:-/tmp/wamrt-pipe}
RES=$WORK/res
mkdir -p "$OUT" "$RES"
# Demos are recorded by two background recorders (clean seeds 100000.., DART-noised seeds 300000..) that keep
# running through training phase A; phase B continues phase A's checkpoints on everything recorded by then.
# The GPU trains while the CPUs record, so the data grows at no device time (2026-12-01: 278 training
# episodes over-fitted, held-out action loss 0.093 against 0.043 on the training frames).
DEMOS=${DEMOS:-700}        # seeds per recorder (an upper bound: the recorders stop at their deadline)
DEMO_S=${DEMO_S:-75}       # recording before phase A starts
WORKERS=${WORKERS:-6}      # per recorder; 2 x 6 leaves cores for the trainers' Python threads
DART_NOISE=${DART_NOISE:-0.02}  # rad, JointNoise std of the DART recorder (12/12 expert successes at 0.02, 6/12 at 0.04)
PHASES=${PHASES:-"A B"}    # training phases; each continues the previous one's checkpoint (--init-from)
PHASE_MIN_A=${PHASE_MIN_A:-3}
PHASE_MIN_B=${PHASE_MIN_B:-6}
INIT=${INIT-src/wamrt/assets/panda-droid}  # phase A starts from this checkpoint ("" = from scratch)
BATCH=${BATCH:-128}
SNAPSHOTS=${SNAPSHOTS:-"3"}  # minutes into the last phase: EMA snapshots (success against training time)
# Variants trained side by side (the H200 is not saturated by one 7.7 M-parameter run): name -> extra flags, and
# DEMOS_<name> -> its demo folders. 2026-12-01 (58640110): noaug 57/200 closed loop, aug (shift 6 px + colour 0.1)
# 0/32, both 9 min from scratch; so both variants continue the embedded policy, without shift augmentation.
VARIANTS=${VARIANTS:-"cont cont_dart"}
VARIANT_cont=${VARIANT_cont:-"--aug-shift 0 --aug-colour 0 --warmup 100 --lr 2e-4"}
VARIANT_cont_dart=${VARIANT_cont_dart:-"--aug-shift 0 --aug-colour 0 --warmup 100 --lr 2e-4"}
VARIANT_noaug=${VARIANT_noaug:-"--aug-shift 0 --aug-colour 0"}
DEMOS_cont=${DEMOS_cont:-"$WORK/demos"}
DEMOS_cont_dart=${DEMOS_cont_dart:-"$WORK/demos $WORK/demos_dart"}
DEMOS_noaug=${DEMOS_noaug:-"$WORK/demos"}
SEL_EPISODES=${SEL_EPISODES:-32}
SEL_LANES=${SEL_LANES:-8}
EVAL_EPISODES=${EVAL_EPISODES:-200}
LANES=${LANES:-16}
EVAL_S=${EVAL_S:-200}
GATE_S=${GATE_S:-240}  # 150 s was too short on 2026-12-01: a 200-episode set took 177 s at 28% success
OTHER_EPISODES=${OTHER_EPISODES:-50}
OTHER_TASKS=${OTHER_TASKS-"lift pick_place_two"}
# In this order, as far as device time goes. nonorm = the served checkpoint with its action normalization
# stripped from wamrt.json (a deployment that lost its statistics): the broken candidate a gate must fail.
# steps1 / guidance0 were no broken candidates for this policy (2026-12-01: -5.0 points each).
GATES=${GATES:-"self nonorm gen-fp8 steps2 interval"}
# 1 (default): servers compute every request alone (wamrt serve --batch-invariant), so rollouts replay bit for
# bit and a gate compares like with like; empty: batched serving (2026-12-01: 26 of 200 self pairs turned).
BATCH_INVARIANT=${BATCH_INVARIANT-1}
THEN=${THEN:-}  # scripts/gpu_run.sh parts to run once the evaluation is done (packed into $OUT)
WAIT_S=${WAIT_S:-570}
TRAIN_ARGS=${TRAIN_ARGS:-}  # appended to every variant (local tests: --size tiny-qwen)
ROLL_ARGS=${ROLL_ARGS:-}    # appended to every rollout and gate (local tests: --max-steps 16)
# shellcheck source=scripts/gpu_lib.sh
source scripts/gpu_lib.sh
export PYTHONPATH=/tmp/wamrt-py/site-packages:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
wamrt() { "$PY" -m wamrt.cli "$@"; }

collect() {  # copy what exists now into $OUT (small files; at most 8 come back)
  cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  tar czf "$OUT/results.tgz" -C "$RES" --exclude='*.npz' --exclude=parts . 2>/dev/null
  cp "$RES"/parts/*.tgz "$OUT/" 2>/dev/null
  local v m best
  for v in $VARIANTS; do
    [ -z "${EVAL_CKPT:-}" ] && [ -f "$WORK/ckpt-$v/wamrt.json" ] \
      && tar czf "$OUT/checkpoint-$v.tgz" -C "$WORK" --exclude=snapshots "ckpt-$v"
  done
  best=$(cat "$WORK/best" 2>/dev/null)
  for m in $SNAPSHOTS; do  # the selected variant's snapshots, one file each (16 MiB a file comes back)
    [ -n "$best" ] && [ -f "$WORK/ckpt-$best/snapshots/${m}min/wamrt.json" ] \
      && tar czf "$OUT/snapshot-$best-${m}min.tgz" -C "$WORK/ckpt-$best/snapshots" "${m}min"
  done
  ls -la "$OUT"
}

wait_pipeline() {
  local until=$(( $(date +%s) + WAIT_S )) seen=0 n
  while [ "$(date +%s)" -lt "$until" ] && [ ! -f "$WORK/done" ]; do
    n=$(wc -l < "$RES/summary.txt" 2>/dev/null || echo 0)
    [ "$n" -gt "$seen" ] && { tail -n +$((seen + 1)) "$RES/summary.txt"; seen=$n; }
    sleep 5
  done
  [ -f "$WORK/done" ] && echo "==== pipeline done ====" || echo "==== still running ($(( $(date +%s) - T0 )) s) ===="
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  collect
  echo "==== summary ===="; cat "$RES/summary.txt"
}

gate() {  # gate NAME CANDIDATE_SPEC: paired with the recorded baseline rollout (same seeds, same request noise)
  log "gate $1: candidate $2"
  timeout "$GATE_S" "$PY" -m wamrt.cli eval gate --task pick_place --episodes "$EVAL_EPISODES" --lanes "$LANES" \
    --seed0 0 --baseline "$BASE" --candidate "$2" --out "$RES/gate-$1.json" $ROLL_ARGS > "$RES/gate-$1.txt" 2>&1
  grep -E "^(candidate|discordant|difference|verdict|replay)" "$RES/gate-$1.txt" | tr '\n' ' ' | sed "s/^/  $1: /" \
    | tee -a "$RES/summary.txt"
  echo | tee -a "$RES/summary.txt"
}

record_bg() {  # record_bg NAME SEED0 OUT NOISE SECONDS: one recorder in the background, pid in REC_<NAME>
  "$PY" -m wamrt.cli train record --task pick_place --episodes "$DEMOS" --seed0 "$2" --workers "$WORKERS" \
    --seconds "$5" --action-noise "$4" --out "$3" > "$RES/demos-$1.txt" 2>&1 &
  eval "REC_$1=$!"
}

count_demos() { local d n=0; for d in "$@"; do n=$((n + $(ls "$d"/*.npz 2>/dev/null | wc -l))); done; echo $n; }

train_phase() {  # train_phase PHASE MINUTES: every variant at once, each continuing its previous checkpoint
  local phase=$1 minutes=$2 v pids=() snaps=""
  [ "$phase" = "${PHASES##* }" ] && snaps=$SNAPSHOTS  # snapshots of the last phase only
  for v in $VARIANTS; do
    local flags_var="VARIANT_$v" demos_var="DEMOS_$v" init_flag=""
    local demos=${!demos_var:-$WORK/demos}
    # shellcheck disable=SC2086
    local n; n=$(count_demos $demos)
    local val=$(( n / 10 < 20 ? n / 10 : 20 ))
    if [ -f "$WORK/ckpt-$v/wamrt.json" ]; then  # the previous phase's result becomes this phase's start
      rm -rf "$WORK/ckpt-$v-prev"; mv "$WORK/ckpt-$v" "$WORK/ckpt-$v-prev"; init_flag="--init-from $WORK/ckpt-$v-prev"
    elif [ -n "$INIT" ]; then init_flag="--init-from $INIT"
    fi
    log "train $v phase $phase: $minutes min on $n episodes ($demos), batch $BATCH, held out $val, ${init_flag:-from scratch}, flags: ${!flags_var}"
    # shellcheck disable=SC2086
    timeout "$("$PY" -c "print(int($minutes * 60 + 300))")" "$PY" -m wamrt.cli train fit --demos $demos \
      --out "$WORK/ckpt-$v" --minutes "$minutes" --batch "$BATCH" --val-episodes "$val" --log-every 100 \
      --snapshot-minutes $snaps $init_flag ${!flags_var} $TRAIN_ARGS > "$RES/train-$v-$phase.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for v in $VARIANTS; do
    cp "$WORK/ckpt-$v/train_log.txt" "$RES/train_log-$v-$phase.txt" 2>/dev/null
    log "train $v phase $phase: $(grep '^done' "$RES/train-$v-$phase.txt" | head -1); last: $(grep '^step' "$RES/train-$v-$phase.txt" | tail -1 | cut -c1-190)"
    if [ ! -f "$WORK/ckpt-$v/wamrt.json" ]; then
      log "train $v phase $phase: NO CHECKPOINT; $(grep -v Warning "$RES/train-$v-$phase.txt" | tail -3)"
      [ -f "$WORK/ckpt-$v-prev/wamrt.json" ] && mv "$WORK/ckpt-$v-prev" "$WORK/ckpt-$v"  # keep the last good one
    fi
  done
}

train_and_select() {
  # ---- demos, recorded in the background through the first phase ------------------------------------------
  local phases=($PHASES) first_min_var="PHASE_MIN_${PHASES%% *}"
  local rec_s; rec_s=$("$PY" -c "print(int($DEMO_S + 60 * ${!first_min_var}))")
  [ ${#phases[@]} -gt 1 ] || rec_s=$DEMO_S
  log "demos: 2 recorders x $WORKERS workers for $rec_s s: clean seeds 100000.., DART ($DART_NOISE rad) seeds 300000.."
  record_bg clean 100000 "$WORK/demos" 0 "$rec_s"
  record_bg dart 300000 "$WORK/demos_dart" "$DART_NOISE" "$rec_s"
  if [ ${#phases[@]} -gt 1 ]; then sleep "$DEMO_S"; else wait "$REC_clean" "$REC_dart"; fi
  log "demos so far: clean $(count_demos "$WORK/demos"), dart $(count_demos "$WORK/demos_dart")"
  [ "$(count_demos "$WORK/demos")" -gt 0 ] || { log "FATAL: no demos"; tail -3 "$RES/demos-clean.txt"; return 1; }
  # ---- training phases, all variants at once --------------------------------------------------------------
  local ph i=0
  for ph in "${phases[@]}"; do
    local min_var="PHASE_MIN_$ph"
    if [ "$i" -eq 1 ]; then  # the recorders stop by their deadline, at about the end of the first phase
      wait "$REC_clean" "$REC_dart"
      cp "$WORK/demos"/stats_*.json "$RES/stats-clean.json" 2>/dev/null
      cp "$WORK/demos_dart"/stats_*.json "$RES/stats-dart.json" 2>/dev/null
      log "demos: clean $(count_demos "$WORK/demos") ($(du -sh "$WORK/demos" | cut -f1)), dart $(count_demos "$WORK/demos_dart"); $(tail -1 "$RES/demos-dart.txt" | cut -c1-200)"
    fi
    train_phase "$ph" "${!min_var}"
    i=$((i + 1))
  done
  rm -rf "$WORK"/ckpt-*-prev
  # ---- selection: a short closed-loop rollout of each variant, all at once --------------------------------
  # Each server already has the evaluation's batch size, so the winner's keeps serving the evaluation.
  local port=8780 best="" best_k=-1 k
  local -a rpids=() up=()
  for v in $VARIANTS; do
    [ -f "$WORK/ckpt-$v/wamrt.json" ] || continue
    port=$((port + 1))
    serve_launch "$v" "$WORK/ckpt-$v" "$port" "$LANES"
  done
  for v in $VARIANTS; do
    [ -f "$WORK/ckpt-$v/wamrt.json" ] || continue
    if serve_ready "$v"; then up+=("$v")
    else  # prompt buckets had not run on a GPU before this script: fall back to exact prompt lengths
      local pv="PORT_$v"
      log "server $v: retrying without prompt buckets"
      PROMPT_BUCKET=0 serve_launch "$v" "$WORK/ckpt-$v" "${!pv}" "$LANES" && serve_ready "$v" && up+=("$v")
    fi
  done
  for v in "${up[@]}"; do
    local pv="PORT_$v"
    timeout 150 "$PY" -m wamrt.cli rollout --url "ws://127.0.0.1:${!pv}" --task pick_place --episodes "$SEL_EPISODES" \
      --lanes "$SEL_LANES" --seed0 1000 --out "$RES/select-$v.json" $ROLL_ARGS > "$RES/select-$v.txt" 2>&1 &
    rpids+=($!)
  done
  [ ${#rpids[@]} -gt 0 ] && wait "${rpids[@]}"
  for v in "${up[@]}"; do
    [ -f "$RES/select-$v.json" ] || continue
    read -r k _ <<< "$(successes "$RES/select-$v.json")"
    log "select $v: $(grep -E '^pick_place' "$RES/select-$v.txt" | head -1); $(grep -E '^stages' "$RES/select-$v.txt" | head -1)"
    [ "$k" -gt "$best_k" ] && { best=$v; best_k=$k; }
  done
  for v in $VARIANTS; do [ "$v" = "$best" ] || serve_stop "$v"; done
  [ -n "$best" ] || { log "FATAL: no variant could be rolled out"; return 1; }
  echo "$best" > "$WORK/best"
  log "best variant: $best ($best_k/$SEL_EPISODES on seeds 1000..)"
  CKPT=$WORK/ckpt-$best
  SERVED=$best
}

evaluate() {  # CKPT served as SERVED (already up, or started here), then the baseline rollout and the gates
  local pid_var="SRV_$SERVED"
  if [ -z "${!pid_var:-}" ]; then serve_start "$SERVED" "$CKPT" 8790 "$LANES" || return 1; fi
  local pb="PORT_$SERVED"
  URL=ws://127.0.0.1:${!pb}
  # ---- evaluation through the server: baseline rollout, then the paired gates -----------------------------
  # The gen-fp8 server compiles and warms up while the baseline runs (it took 117 s when started later).
  if [[ " $GATES " == *" nonorm "* ]]; then
    rm -rf "$WORK/nonorm"; cp -r "$CKPT" "$WORK/nonorm"
    "$PY" -c "import json, sys; p = sys.argv[1] + '/wamrt.json'; c = json.load(open(p))
c.pop('action_normalization', None); json.dump(c, open(p, 'w'), indent=2)" "$WORK/nonorm" \
      && serve_launch nonorm "$WORK/nonorm" 8772 "$LANES"
  fi
  # A gate named after a gen-fp8* recipe (gen-fp8, gen-fp8-skip-first, ...) serves the checkpoint quantized with it.
  local g iv port=8781
  for g in $GATES; do
    [[ $g == gen-fp8* ]] || continue
    "$PY" -m wamrt.cli quantize --model "$CKPT" --recipe "$g" --out "$WORK/$g" > "$RES/quantize-$g.txt" 2>&1 \
      && serve_launch "$(ident "$g")" "$WORK/$g" $port "$LANES"
    log "quantize: $(tail -1 "$RES/quantize-$g.txt" | cut -c1-160)"
    port=$((port + 1))
  done
  BASE=$RES/rollout-pick_place-$EVAL_EPISODES.json
  log "eval: $EVAL_EPISODES episodes of pick_place, $LANES lanes, 4 steps, guidance 3${BATCH_INVARIANT:+, batch-invariant server}"
  timeout "$EVAL_S" "$PY" -m wamrt.cli rollout --url "$URL" --task pick_place --episodes "$EVAL_EPISODES" \
    --lanes "$LANES" --seed0 0 --out "$BASE" $ROLL_ARGS > "$RES/eval.txt" 2>&1
  log "eval: $(grep -E '^pick_place' "$RES/eval.txt" | head -1); $(grep -E '^stages' "$RES/eval.txt" | head -1)"
  [ -f "$BASE" ] || { log "FATAL: no baseline rollout"; tail -5 "$RES/eval.txt"; return 1; }
  # One gate at a time: two at once (32 lanes, two servers) ran past their limits on 2026-12-01.
  local srv port_var
  for g in $GATES; do
    case $g in
      self) gate self "$URL" ;;
      steps1) gate steps1 "$URL:steps=1" ;;
      steps2) gate steps2 "$URL:steps=2" ;;
      interval)  # CFG on the first step only: the interval is strict, so (t1, t0 + 1) keeps the first timestep
        iv=$("$PY" -c "from wamrt.pipeline.denoise import SamplingOptions as S
t = S(steps=4).make_schedule().timesteps.tolist(); print(f'{int(t[1])}-{int(t[0]) + 1}')")
        gate interval "$URL:guidance_interval=$iv" ;;
      gen-fp8*)
        srv=$(ident "$g"); port_var=PORT_$srv; pid_var=SRV_$srv
        [ -n "${!pid_var:-}" ] && serve_ready "$srv" && gate "$g" "ws://127.0.0.1:${!port_var}"; serve_stop "$srv" ;;
      nonorm) [ -n "${SRV_nonorm:-}" ] && serve_ready nonorm && gate nonorm ws://127.0.0.1:8772; serve_stop nonorm ;;
      guidance0) gate guidance0 "$URL:guidance=0" ;;
      *) log "unknown gate $g" ;;
    esac
  done
  # ---- the other tasks (the policy was trained on pick_place only) ---------------------------------------
  local task
  for task in $OTHER_TASKS; do
    timeout 120 "$PY" -m wamrt.cli rollout --url "$URL" --task "$task" --episodes "$OTHER_EPISODES" \
      --lanes "$LANES" --seed0 0 --out "$RES/rollout-$task-$OTHER_EPISODES.json" $ROLL_ARGS > "$RES/other-$task.txt" 2>&1
    log "other: $(grep -E "^$task" "$RES/other-$task.txt" | head -1)"
  done
  grep -E "capturing a CUDA graph" -c "$RES/server-$SERVED.txt" | sed 's/^/graph captures (served policy, whole run): /' \
    | tee -a "$RES/summary.txt"
  serve_stop "$SERVED"
}

run_pipeline() {
  if [ -n "${EVAL_CKPT:-}" ]; then  # evaluation only, of a checkpoint already trained
    CKPT=$EVAL_CKPT SERVED=eval
    echo eval > "$WORK/best"
  else
    train_and_select || return 1
  fi
  evaluate
  if [ -n "$THEN" ]; then  # the GPU is free now: the benchmark parts, from the tree the latest call sent
    log "then: scripts/gpu_run.sh $THEN"
    # shellcheck disable=SC2086
    (cd "$REPO" && OUT=$RES/parts bash scripts/gpu_run.sh $THEN > "$RES/parts.txt" 2>&1)
    log "then: done; $(grep -E '^part ' "$RES/parts.txt" | tr '\n' ' ')"
  fi
}

case ${1:-start} in
  start)
    rm -rf "$WORK"; mkdir -p "$RES"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    install_carried || exit 1
    choose_gl || exit 1
    # The pipeline runs from a snapshot of this tree: a later call re-sends the tree, which must not change
    # the code under a running stage.
    mkdir -p "$WORK/src" && cp -r scripts src pyproject.toml "$WORK/src/"
    (cd "$WORK/src" && MUJOCO_GL=$MUJOCO_GL PYOPENGL_PLATFORM=$PYOPENGL_PLATFORM setsid nohup bash -c \
      "bash scripts/gpu_pipeline.sh run; touch '$WORK/done'" > "$WORK/pipeline.log" 2>&1 < /dev/null &)
    wait_pipeline ;;
  run) run_pipeline || log "pipeline stopped early" ;;
  wait) wait_pipeline ;;
  *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
