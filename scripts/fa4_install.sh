#!/usr/bin/env bash
# Installs flash-attn-4 (the "fa4" attention backend) on the GPU machine into /tmp/site, from carried, git-ignored
# folders (see docs/performance notes in bench/results/latency/README.md):
#   .fa4/        flash-attn-4 4.0.0b36 and its small dependencies as wheels (nvidia-cutlass-dsl 4.8.1 and its
#                -libs-base / -libs-core, apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels)
#   .fa4-part1/, .fa4-part2/
#                the contents of the 92 MB nvidia-cutlass-dsl-libs-cu13 wheel as an xz tar split in two: a call
#                carries at most 64 MiB, so the first part travels one call earlier and stays on the warm machine.
# Prints the PYTHONPATH entry the DSL needs (its wheel adds it with a .pth file, which --target installs skip).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4/*.whl >&2
cat .fa4-part1/cu13.tar.xz.* .fa4-part2/cu13.tar.xz.* | xz -d | tar x -C /tmp/site
echo /tmp/site/nvidia_cutlass_dsl/dsl_packages
