# Sourced by scripts/gpu_pipeline.sh: install the carried wheels,
# pick a headless GL, start / stop `wamrt serve`. Expects PY, RES (results folder) and T0 (start time) set.

log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/summary.txt"; }

# The common start of a part script run from the repository root with RES set: OUT and PY defaults, T0 = now, the
# folders, the GL debs unpacked (unpack_gl) and a headless GL chosen (choose_gl).
part_start() {
  OUT=${OUT:-/tmp/out}
  PY=${PY:-python3}
  T0=$(date +%s)
  export T0 RES
  mkdir -p "$RES" "$OUT"
  unpack_gl  # gpu_run.sh installed the wheels; the EGL libraries come as debs
  choose_gl
}

# Carried (git-ignored) folders: .whl/ (mujoco 4.0.0 + mujoco-core/studio, glfw, pyopengl, diffusers,
# importlib_metadata, starlette, uvicorn, websockets, python-multipart; installed --no-deps into /tmp/wamrt-py/site-packages)
# and .gl/ (libglvnd EGL/GL debs, unpacked into /). SKIP_INSTALL=1 uses the current environment (local tests).
install_carried() {
  if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/wamrt-py/site-packages .whl/*.whl \
      || { log "FATAL: wheel install failed"; return 1; }
  fi
  unpack_gl
}

# The EGL / GL debs of .gl/ unpacked into / (the parts gpu_run.sh starts have their wheels installed already);
# SKIP_INSTALL=1: nothing (local runs).
unpack_gl() {
  if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    for f in .gl/*.deb; do dpkg -x "$f" / || log "warning: dpkg -x $f failed"; done
    ldconfig 2>/dev/null || true
  fi
}

# Sets and exports MUJOCO_GL / PYOPENGL_PLATFORM: EGL (the GPU), else EGL with the NVIDIA vendor file named,
# else OSMesa (CPU, slow).
choose_gl() {
  export PYTHONUNBUFFERED=1 PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-egl}
  local probe='import mujoco; c = mujoco.GLContext(64, 64); c.make_current(); r = mujoco.Renderer(mujoco.MjModel.from_xml_string("<mujoco/>"), 32, 32); c.free()'
  gl_ok() { MUJOCO_GL=$1 PYOPENGL_PLATFORM=$1 timeout 60 "$PY" -c "$probe" >"$RES/gl-$1.txt" 2>&1; }
  if [ -n "${MUJOCO_GL:-}" ] && gl_ok "$MUJOCO_GL"; then GL=$MUJOCO_GL
  elif gl_ok egl; then GL=egl
  else
    local vendor=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json cand
    for cand in $vendor /usr/share/glvnd/egl_vendor.d/10_nvidia.json /etc/glvnd/egl_vendor.d/10_nvidia.json; do
      [ -f "$cand" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$cand && break
    done
    if gl_ok egl; then GL=egl
    elif gl_ok osmesa; then GL=osmesa; log "WARNING: EGL failed, rendering with OSMesa (CPU, slow)"
    else
      log "FATAL: no headless GL (EGL and OSMesa both failed). EGL probe said:"; tail -5 "$RES/gl-egl.txt"
      return 1
    fi
  fi
  export MUJOCO_GL=$GL PYOPENGL_PLATFORM=$GL
  log "setup done: MUJOCO_GL=$GL ${__EGL_VENDOR_LIBRARY_FILENAMES:+vendor=$__EGL_VENDOR_LIBRARY_FILENAMES}"
}

# A server NAME for a label that may hold '-' or '+' (a recipe name): NAME becomes part of variable names.
ident() { echo "${1//[^A-Za-z0-9_]/_}"; }

# serve_launch NAME CKPT PORT MAX_BATCH: `wamrt serve` (fast engine, CUDA graphs) in the background, pid in
# SRV_<NAME>, port in PORT_<NAME>; serve_ready NAME waits for /readyz. Prompt buckets of 64 tokens: one graph per
# batch size serves every instruction mix of the lanes (exact lengths would capture one per mix). BATCH_INVARIANT=1:
# every batch padded to MAX_BATCH rows, so rollouts replay bit for bit and paired gates compare like with like.
# SERVE_ARGS: more `wamrt serve` flags (e.g. --added-latency-ms 560).
serve_launch() {
  local name=$1 ckpt=$2 port=$3 batch=$4
  "$PY" -m wamrt.cli serve --model "$ckpt" --port "$port" --max-batch "$batch" --max-wait-ms 5 --max-queue 512 \
    --prompt-bucket "${PROMPT_BUCKET:-64}" ${BATCH_INVARIANT:+--batch-invariant} ${SERVE_ARGS:-} > "$RES/server-$name.txt" 2>&1 &
  eval "SRV_$name=$!; PORT_$name=$port"
}
serve_ready() {
  local pid_var="SRV_$1" port_var="PORT_$1"
  local pid=${!pid_var} port=${!port_var}
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && { log "server $1 ready on port $port"; return 0; }
    kill -0 "$pid" 2>/dev/null || break; sleep 1
  done
  log "FATAL: server $1 not ready: $(grep -v Warning "$RES/server-$1.txt" | tail -3 | tr '\n' ' ' | cut -c1-400)"
  return 1
}
serve_start() { serve_launch "$@" && serve_ready "$1"; }
serve_stop() {
  local var="SRV_$1"
  local pid=${!var:-}
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  eval "SRV_$1="
}

# The rate line of a rollout JSON: "k n".
successes() { "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['successes'], r['episodes'])" "$1" 2>/dev/null || echo "0 0"; }

# A checkpoint carried from an earlier session (a fresh machine has none in /tmp): `scripts/carry_fetch.sh --ckpt
# TGZ` packs a returned prefix-ckpt.tgz without its VAE (panda-droid's, the same bytes) into .ckpt-carry/ckpt.tgz,
# ~12 MB of the call's 64 MiB. `carried_ckpt PATH` prints a folder: PATH itself, or a .tgz unpacked once under
# /tmp/wamrt-carried/ with panda-droid's VAE put back where it is missing.
carried_ckpt() {
  case $1 in
    *.tgz|*.tar.gz)
      local dir; dir=/tmp/wamrt-carried/$(basename "$1" | sed 's/\.t\(ar\.\)\?gz$//')
      if [ ! -f "$dir/wamrt.json" ]; then
        rm -rf "$dir" && mkdir -p "$dir" && tar xzf "$1" -C "$dir" || return 1
        [ -d "$dir/vae" ] || cp -r src/wamrt/assets/panda-droid/vae "$dir/vae"
      fi
      echo "$dir" ;;
    *) echo "$1" ;;
  esac
}
