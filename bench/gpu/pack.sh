#!/usr/bin/env bash
# pack.sh BUILD_DIR [NAME...]: gathers BUILD_DIR/bin/* (or only the named binaries, e.g.
# burst-server burst-worker libburst_spm.so) and the shared libraries they need that the GPU
# machine lacks into .devpack/ (git-ignored) with .devpack/env.sh, for the device `run` tool
# (carry [".devpack"]). CUDA, cuBLAS, cuDNN and NCCL stay behind: the GPU machine has its own.
# The copies are stripped: the `run` tool carries at most 64 MiB with the working tree, and
# every binary holds sm_80 and sm_90a code. Uses ../shared/tools/devpack, or $DEVPACK when set.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [NAME...]   (e.g. build-cuda)" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "$1" && pwd)
shift
devpack=${DEVPACK:-$root/../shared/tools/devpack}
[ -x "$devpack" ] || devpack=/work/shared/tools/devpack
[ -d "$build/bin" ] || { echo "no $build/bin: build first" >&2; exit 1; }
files=()
if [ $# -gt 0 ]; then
  for n in "$@"; do files+=("$build/bin/$n"); done
else
  files=("$build"/bin/*)
fi
cd "$root"
rm -rf .devpack
"$devpack" .devpack "${files[@]}"
strip --strip-unneeded .devpack/bin/* .devpack/lib/* 2>/dev/null || true
du -sh .devpack
