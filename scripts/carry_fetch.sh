#!/usr/bin/env bash
# Builds the git-ignored folders the device parts carry (a new checkout has none), on a CPU machine with pip and apt:
#   .whl/        the simulator and server wheels for the device's Python 3.12 (mujoco 4.0.0 and mujoco-core,
#                glfw, pyopengl -- not mujoco-studio, 13 MB of viewer that `import mujoco` never loads; diffusers
#                0.42.1, importlib_metadata; starlette, uvicorn, websockets, python-multipart): what scripts/gpu_run.sh
#                installs --no-deps. The device image has numpy, pandas, pyarrow, msgpack and prometheus-client already
#                (../.library/device/KINDS.md).
#   .whl-bench/  diffusers, importlib_metadata and the server wheels alone (~7 MB), for parts that carry flash-attn-4.
#   .gl/         libglvnd's EGL / GL loader debs, which scripts/gpu_lib.sh unpacks into / for MuJoCo's headless EGL.
#   .whl-av/     PyAV for the server's MP4 replies (parts world-serve, load-plan-i2v), its wheel unpacked and packed as
#                tar.xz (25 MB against the wheel's 36, which does not fit a call beside the tree and .whl-bench);
#                scripts/gpu_run.sh unpacks it into its site-packages.
# flash-attn-4's folders come from scripts/fa4_fetch.sh.
# `--ckpt TGZ` only packs a prefix-ckpt.tgz an earlier call returned into .ckpt-carry/ckpt.tgz, without its VAE
# (panda-droid's; scripts/gpu_lib.sh's carried_ckpt puts it back on the device), for `INIT=.ckpt-carry/ckpt.tgz`
# (scripts/prefix_train.sh) or `TRAINED=.ckpt-carry/ckpt.tgz` (scripts/realtime_grid.sh) on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --ckpt ]; then
  src=$(realpath "${2:?--ckpt TGZ}")
  grep -qx "/.ckpt-carry/" .git/info/exclude 2>/dev/null || echo "/.ckpt-carry/" >> .git/info/exclude
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  tar xzf "$src" -C "$tmp"
  cmp -s "$tmp/vae/diffusion_pytorch_model.safetensors" src/wamrt/assets/panda-droid/vae/diffusion_pytorch_model.safetensors \
    || { echo "the checkpoint's VAE is not panda-droid's: carry the whole tgz instead" >&2; exit 1; }
  mkdir -p .ckpt-carry
  tar czf .ckpt-carry/ckpt.tgz -C "$tmp" --exclude=vae .
  du -sh .ckpt-carry/ckpt.tgz
  exit 0
fi
for d in .whl .whl-bench .gl .whl-av; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms "$@" \
  2> >(grep -v "^WARNING: Location" >&2); }
server=(diffusers==0.42.1 importlib_metadata zipp starlette uvicorn websockets python-multipart)
rm -rf .whl .whl-bench .gl .whl-av
get -d .whl mujoco==4.0.0 mujoco-core==4.0.0 glfw pyopengl "${server[@]}"
get -d .whl-bench "${server[@]}"
mkdir -p .gl
(cd .gl && apt-get download -q libegl1 libglvnd0 libgl1 libglx0 libopengl0 libgles2 >/dev/null)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
get -d "$tmp" av==18.1.0
mkdir -p "$tmp/unpacked" .whl-av
(cd "$tmp/unpacked" && python3 -m zipfile -e "$tmp"/av-*.whl . && tar cJf "$OLDPWD/.whl-av/av-18.1.0.tar.xz" .)
du -sh .whl .whl-bench .gl .whl-av
