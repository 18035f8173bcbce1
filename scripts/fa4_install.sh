#!/usr/bin/env bash
# Installs flash-attn-4 (the "fa4" attention backend) on the GPU machine into /tmp/wamrt-py/site-packages from carried, git-ignored
# folders (scripts/fa4_fetch.sh builds them on a CPU machine):
#   .fa4/        flash-attn-4 4.0.0b36 and its small dependencies as wheels (nvidia-cutlass-dsl 4.8.1 and its
#                -libs-base / -libs-core, apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels), and cu13.parts: N
#   .fa4-part1/ ... .fa4-partN/
#                the contents of the 92 MB nvidia-cutlass-dsl-libs-cu13 wheel as an xz tar (~66 MB) split in N: a
#                call carries at most 64 MiB with the tree (~32 MB), so the parts travel in separate calls.
# A carried folder does not outlive its call (measured 2026-12-02: the next call's tree had no .fa4*), but /tmp on a
# warm machine does: every call that carries a part runs this script, which stages what it finds in
# /tmp/wamrt-fa4 and installs once all of them are there. Exit 3: staged, not complete yet. On success prints the
# PYTHONPATH entry the DSL needs (its wheel adds it with a .pth file, which --target installs skip).
# The target is a folder named site-packages: quack (the GEMM library flash-attn-4 depends on) fingerprints its compiled
# epilogues by recursing into every function they reach, except installed ones, which it recognises by a
# `/site-packages/` in their path; from any other folder it recurses into the CuTe DSL itself and fails on a
# ContextVar there (measured 2026-12-02 with quack 0.6.5 and nvidia-cutlass-dsl 4.8.1 in /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=/tmp/wamrt-fa4
mkdir -p "$stage"
for d in .fa4 .fa4-part*; do [ -d "$d" ] && cp -r "$d" "$stage/"; done
[ -f "$stage/.fa4/cu13.parts" ] || { echo "fa4: staged, .fa4 still missing" >&2; exit 3; }
parts=$(cat "$stage/.fa4/cu13.parts")
for i in $(seq "$parts"); do
  [ -d "$stage/.fa4-part$i" ] || { echo "fa4: staged, .fa4-part$i of $parts still missing" >&2; exit 3; }
done
if [ ! -f /tmp/wamrt-py/site-packages/.fa4-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wamrt-py/site-packages "$stage"/.fa4/*.whl >&2
  for i in $(seq "$parts"); do cat "$stage/.fa4-part$i"/cu13.tar.xz.*; done | xz -d | tar x -C /tmp/wamrt-py/site-packages
  touch /tmp/wamrt-py/site-packages/.fa4-installed
fi
echo /tmp/wamrt-py/site-packages/nvidia_cutlass_dsl/dsl_packages
