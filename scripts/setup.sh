#!/usr/bin/env bash
# Create ./.venv (Python >= 3.11) with CPU torch and wamrt installed editable with its dev extras.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
pip_install() {
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
}
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
pip_install "torch==${WAMRT_TORCH_VERSION:-2.13.0}"
pip_install -e '.[dev]'
# openpi-client (the third-party websocket client the tests speak to) pins numpy<2 although its client
# needs only msgpack/numpy/websockets: install it without its pins.
pip_install --no-deps "openpi-client==0.1.2"
rm -f "$log"
.venv/bin/python -c "import torch, diffusers, wamrt; print('ready: torch', torch.__version__, '| diffusers', diffusers.__version__, '| wamrt', wamrt.__version__)"
