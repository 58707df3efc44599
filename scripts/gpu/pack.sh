#!/usr/bin/env bash
# pack.sh BUILD_DIR: gathers BUILD_DIR/bin/* and the shared libraries they need that the GPU
# machine lacks into .devpack/ (git-ignored) with .devpack/env.sh, for the device `run` tool
# (carry [".devpack"]). CUDA, cuBLAS, cuDNN and NCCL stay behind: the GPU machine has its own.
# Uses ../shared/tools/devpack, or $DEVPACK when set.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 BUILD_DIR   (e.g. build-cuda)" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "$1" && pwd)
devpack=${DEVPACK:-$root/../shared/tools/devpack}
[ -x "$devpack" ] || devpack=/work/shared/tools/devpack
[ -d "$build/bin" ] || { echo "no $build/bin: build first" >&2; exit 1; }
cd "$root"
rm -rf .devpack
"$devpack" .devpack "$build"/bin/*
