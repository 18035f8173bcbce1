#!/usr/bin/env bash
# Builds the git-ignored folders scripts/fa4_install.sh installs flash-attn-4 from, on a CPU machine with pip access
# (a new checkout has none of them):
#   .fa4/                flash-attn-4 4.0.0b36 and its small dependencies as wheels, and cu13.parts (how many parts)
#   .fa4-part1/ ...      the 92 MB nvidia-cutlass-dsl-libs-cu13 wheel's contents as an xz tar (~66 MB), split so
#                        that each part travels in one device call beside the working tree (64 MiB a call in all;
#                        the tracked tree alone is ~37 MB at bc07013, and grows with committed results): PART_MB
#                        (default 17: four parts; at 22 the first call, .fa4 + part 1, was refused once the tree
#                        passed ~35 MB) per part. `du -cb $(git ls-files)` gives the tree's size.
# Also .whl-bench (diffusers 0.42.1, importlib_metadata and the server wheels: what the benches need, ~7 MB).
# Then: one `run` per part carrying `.fa4` with the first and the part alone after it (each runs fa4_install.sh,
# which stages what it is given in /tmp on the warm machine); the last call carries `.whl-bench` too.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .fa4 .fa4-part1 .fa4-part2 .fa4-part3 .fa4-part4 .fa4-part5 .whl-bench; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms "$@"; }
get -d .whl-bench diffusers==0.42.1 importlib_metadata starlette uvicorn websockets python-multipart
rm -rf .fa4 .fa4-part* && mkdir -p .fa4
get -d .fa4 flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi torch-c-dlpack-ext quack-kernels==0.6.5
tmp=$(mktemp -d)
get -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd "$tmp" && mkdir x && cd x && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && tar c . | xz -T0 -6 > ../cu13.tar.xz)
(cd "$tmp" && split -b "${PART_MB:-17}M" -d cu13.tar.xz cu13.tar.xz.)
n=0
for f in "$tmp"/cu13.tar.xz.[0-9]*; do n=$((n + 1)); mkdir -p ".fa4-part$n"; mv "$f" ".fa4-part$n/"; done
echo "$n" > .fa4/cu13.parts
rm -rf "$tmp"
du -sh .fa4 .fa4-part* .whl-bench
