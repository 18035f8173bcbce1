#!/usr/bin/env bash
# Create ./.venv (Python >= 3.11) with torch and wamrt installed editable with its dev extras.
# Idempotent: re-running only installs what is missing.
#
# Which torch: torch==2.13.0 (WAMRT_TORCH_VERSION) from pip's configured indexes. From PyPI on Linux x86_64 that is
# the CUDA build (~530 MB plus ~17 nvidia-* wheels, a few GB); on a machine whose pip finds a local CPU wheel first
# it is that one. WAMRT_TORCH=cpu installs the CPU build from download.pytorch.org/whl/cpu (~200 MB) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${WAMRT_TORCH_VERSION:-2.13.0}
case "${WAMRT_TORCH:-default}" in
  default) torch_from=() ;;
  cpu) torch_from=(--index-url https://download.pytorch.org/whl/cpu) ;;
  *) echo "setup: WAMRT_TORCH must be 'cpu' or unset, got '${WAMRT_TORCH}'" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
pip_install() {
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
}
# torch first and pinned, so that wamrt's own `torch` requirement finds it installed and pulls nothing else.
pip_install "torch==${TORCH_VERSION}" ${torch_from[@]+"${torch_from[@]}"}
pip_install -e '.[dev]'
# openpi-client (the third-party websocket client the tests speak to) pins numpy<2 although its client
# needs only msgpack/numpy/websockets: install it without its pins.
pip_install --no-deps "openpi-client==0.1.2"
rm -f "$log"
.venv/bin/python -c "import torch, diffusers, wamrt; print('ready: torch', torch.__version__, \
'(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU build)', '| diffusers', \
diffusers.__version__, '| wamrt', wamrt.__version__)"
