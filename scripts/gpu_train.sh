#!/usr/bin/env bash
# Train the embedded panda-droid policy on the lent H200, in ONE device call (< 600 s), or evaluate one.
#
#   bash scripts/gpu_train.sh            # MODE=train: setup, demos, training, sanity rollout
#   MODE=eval CKPT=src/wamrt/assets/panda-droid bash scripts/gpu_train.sh   # 200-episode eval + paired gates
#   MODE=eval CKPT=... BASE_FROM=rollout.json GATES="interval gen-fp8" ...     # more gates, same baseline
#
# Carried (git-ignored) folders: .whl/ (mujoco 4.0.0 + mujoco-core/studio, glfw, pyopengl, diffusers,
# importlib_metadata; installed --no-deps into /tmp/site) and .gl/ (libglvnd EGL/GL debs, unpacked into /).
# Seeds: demos 100000.. (train record default); evaluation and its paired gates 0.. (never trained on).
# Knobs (env): DEMOS DEMO_S WORKERS TRAIN_MIN VAL_EPISODES BATCH EPISODES LANES ROLL_S EVAL_EPISODES GATES BASE_FROM
#   EVAL_S GATE_S SIZE; PY (python, default python3); SKIP_INSTALL=1 (local tests: use the current env).
# Writes into $OUT: checkpoint.tgz (the checkpoint folder), run.tgz (logs, demo stats, rollout/gate JSON),
# train_log.txt, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODE=${MODE:-train}
PY=${PY:-python3}
WORK=${WORK:-/tmp/wamrt-train}
DEMOS=${DEMOS:-400}          # episodes attempted (recording stops at DEMO_S anyway)
DEMO_S=${DEMO_S:-75}
WORKERS=${WORKERS:-15}
TRAIN_MIN=${TRAIN_MIN:-5.5}
VAL_EPISODES=${VAL_EPISODES:-20}  # held out of training (at most a tenth of the demos); the log reports their loss
BATCH=${BATCH:-128}
SIZE=${SIZE:-policy-s}
EPISODES=${EPISODES:-50}
LANES=${LANES:-14}           # simulator processes = websocket clients (the server batches up to this many)
ROLL_S=${ROLL_S:-100}
EVAL_EPISODES=${EVAL_EPISODES:-200}
GATES=${GATES:-"self steps1 steps2 interval gen-fp8"}  # gen-fp8 last
EVAL_S=${EVAL_S:-150}
GATE_S=${GATE_S:-90}
RES=$WORK/res
mkdir -p "$RES"
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/summary.txt"; }
wamrt() { "$PY" -m wamrt.cli "$@"; }

# ---- (i) setup --------------------------------------------------------------------------------------
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "FATAL: wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD/src
  for f in .gl/*.deb; do dpkg -x "$f" / || log "warning: dpkg -x $f failed"; done
  ldconfig 2>/dev/null || true
fi
export PYTHONUNBUFFERED=1 PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-egl}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
probe='import mujoco; c = mujoco.GLContext(64, 64); c.make_current(); r = mujoco.Renderer(mujoco.MjModel.from_xml_string("<mujoco/>"), 32, 32); c.free()'
gl_ok() { MUJOCO_GL=$1 PYOPENGL_PLATFORM=$1 timeout 60 "$PY" -c "$probe" >"$RES/gl-$1.txt" 2>&1; }
if [ -n "${MUJOCO_GL:-}" ] && gl_ok "$MUJOCO_GL"; then GL=$MUJOCO_GL
elif gl_ok egl; then GL=egl
else
  vendor=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  for cand in $vendor /usr/share/glvnd/egl_vendor.d/10_nvidia.json /etc/glvnd/egl_vendor.d/10_nvidia.json; do
    [ -f "$cand" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$cand && break
  done
  if gl_ok egl; then GL=egl
  elif gl_ok osmesa; then GL=osmesa; log "WARNING: EGL failed, rendering with OSMesa (CPU, slow)"
  else
    log "FATAL: no headless GL (EGL and OSMesa both failed). EGL probe said:"; tail -5 "$RES/gl-egl.txt"
    ls /usr/local/nvidia/share/glvnd/egl_vendor.d /usr/share/glvnd/egl_vendor.d 2>&1 | head; exit 1
  fi
fi
export MUJOCO_GL=$GL PYOPENGL_PLATFORM=$GL
log "setup done: MUJOCO_GL=$GL ${__EGL_VENDOR_LIBRARY_FILENAMES:+vendor=$__EGL_VENDOR_LIBRARY_FILENAMES}"

# Rollouts go through the real server (`wamrt serve`: fast engine, CUDA graphs, batching across lanes);
# the lanes are simulator processes, each an openpi websocket client (`wamrt rollout --url`).
PORT=${PORT:-8770}
URL=ws://127.0.0.1:$PORT
serve_start() {
  "$PY" -m wamrt.cli serve --model "$CKPT" --port "$PORT" --max-batch "$LANES" --max-wait-ms 5 --max-queue 256 \
    > "$RES/server.txt" 2>&1 &
  SRV=$!
  for _ in $(seq 1 90); do curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && { log "server ready ($URL)"; return 0; }
    kill -0 "$SRV" 2>/dev/null || break; sleep 2; done
  log "FATAL: server not ready"; tail -20 "$RES/server.txt"; return 1
}
serve_stop() { [ -n "${SRV:-}" ] && kill "$SRV" 2>/dev/null; wait "${SRV:-}" 2>/dev/null; SRV=; }

pack() {
  [ -d "$CKPT" ] && [ "$MODE" = train ] && tar czf "$OUT/checkpoint.tgz" -C "$(dirname "$CKPT")" "$(basename "$CKPT")"
  cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  [ -f "$CKPT/train_log.txt" ] && [ "$MODE" = train ] && cp "$CKPT/train_log.txt" "$OUT/train_log.txt"
  tar czf "$OUT/run.tgz" -C "$RES" . 2>/dev/null
  echo "==== summary ($MODE, $(( $(date +%s) - T0 )) s) ===="; cat "$RES/summary.txt"
  ls -la "$OUT"
}

if [ "$MODE" = train ]; then
  CKPT=${CKPT:-$WORK/panda-droid}
  rm -rf "$CKPT" "$WORK/demos"
  # ---- (ii) demos ---------------------------------------------------------------------------------------
  log "demos: pick_place, up to $DEMOS episodes, $WORKERS workers, $DEMO_S s"
  timeout $((DEMO_S + 60)) "$PY" -m wamrt.cli train record --task pick_place --episodes "$DEMOS" --workers "$WORKERS" \
    --seconds "$DEMO_S" --out "$WORK/demos" 2>&1 | tail -3 | tee -a "$RES/demos.txt"
  cp "$WORK/demos"/stats_*.json "$RES/" 2>/dev/null
  n=$(ls "$WORK/demos"/*.npz 2>/dev/null | wc -l)
  log "demos: $n episodes written ($(du -sh "$WORK/demos" | cut -f1))"
  [ "$n" -gt 0 ] || { log "FATAL: no demos"; pack; exit 1; }
  # ---- (iii) training -----------------------------------------------------------------------------------
  log "train: $SIZE, $TRAIN_MIN min, batch $BATCH"
  timeout "$("$PY" -c "print(int($TRAIN_MIN * 60 + 120))")" "$PY" -m wamrt.cli train fit --demos "$WORK/demos" \
    --out "$CKPT" --minutes "$TRAIN_MIN" --batch "$BATCH" --size "$SIZE" --val-episodes "$(( n / 10 < VAL_EPISODES ? n / 10 : VAL_EPISODES ))" \
    --log-every 100 2>&1 \
    | grep -v Warning | tee "$RES/train_stdout.txt" | grep -E "^(step|done|data|wrote)" | awk 'NR % 5 == 1 || /done|wrote|data/'
  [ -f "$CKPT/wamrt.json" ] || { log "FATAL: training wrote no checkpoint"; pack; exit 1; }
  log "train: $(grep '^done' "$CKPT/train_log.txt")  last: $(grep '^step' "$CKPT/train_log.txt" | tail -1 | cut -c1-170)"
  log "checkpoint: $(du -sh "$CKPT" | cut -f1) at $CKPT"
  # ---- (v) sanity rollout -------------------------------------------------------------------------------
  log "rollout: $EPISODES episodes, $LANES lanes against the server"
  if serve_start; then
    timeout "$ROLL_S" "$PY" -m wamrt.cli rollout --url "$URL" --task pick_place --episodes "$EPISODES" \
      --lanes "$LANES" --seed0 0 --out "$RES/rollout-sanity.json" 2>&1 | grep -v Warning | tail -3 \
      | tee -a "$RES/summary.txt"
  fi
  serve_stop
  pack
else
  CKPT=${CKPT:?MODE=eval needs CKPT=checkpoint folder}
  serve_start || { pack; exit 1; }
  BASE=$RES/rollout-pick_place-$EVAL_EPISODES.json
  if [ -n "${BASE_FROM:-}" ]; then  # a rollout JSON carried from an earlier call: pair new gates with it
    cp "$BASE_FROM" "$BASE" && log "baseline: $BASE_FROM"
  else
    log "eval: $EVAL_EPISODES episodes of pick_place, $LANES lanes, 4 steps, guidance 3"
    timeout "$EVAL_S" "$PY" -m wamrt.cli rollout --url "$URL" --task pick_place --episodes "$EVAL_EPISODES" \
      --lanes "$LANES" --seed0 0 --out "$BASE" 2>&1 | grep -v Warning | tail -2 | tee -a "$RES/summary.txt"
  fi
  # Every gate pairs its candidate with that rollout (same seeds, same per-request noise): the baseline
  # runs once. self / steps1 show the gate works both ways (issue 6); the rest are issue 7's lossy levers.
  gate() {
    log "gate $1: candidate $2, $EVAL_EPISODES paired seeds"
    timeout "$GATE_S" "$PY" -m wamrt.cli eval gate --task pick_place --episodes "$EVAL_EPISODES" --lanes "$LANES" \
      --seed0 0 --baseline "$BASE" --candidate "$2" --out "$RES/gate-$1.json" 2>&1 | grep -v Warning | tail -4 \
      | tee -a "$RES/summary.txt"
  }
  [ -f "$BASE" ] || GATES=
  for g in $GATES; do
    case $g in
      self) gate self "$URL" ;;
      steps1) gate steps1 "$URL:steps=1" ;;
      steps2) gate steps2 "$URL:steps=2" ;;
      interval)  # CFG on the first step only: the interval is strict, so (t1, t0 + 1) keeps the first timestep
        iv=$("$PY" -c "from wamrt.pipeline.denoise import SamplingOptions as S
t = S(steps=4).make_schedule().timesteps.tolist(); print(f'{int(t[1])}-{int(t[0]) + 1}')")
        gate interval "$URL:guidance_interval=$iv" ;;
      gen-fp8)  # a second server on the quantized artifact (last: it replaces the bf16 server)
        serve_stop
        "$PY" -m wamrt.cli quantize --model "$CKPT" --recipe gen-fp8 --out "$WORK/gen-fp8" 2>&1 | tail -1 \
          | tee -a "$RES/summary.txt"
        CKPT_BF16=$CKPT; CKPT=$WORK/gen-fp8
        serve_start && gate gen-fp8 "$URL"
        CKPT=$CKPT_BF16 ;;
      *) log "unknown gate $g" ;;
    esac
  done
  serve_stop
  pack
fi
