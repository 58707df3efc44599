#!/usr/bin/env bash
# Configures and builds burst into build/ (binaries in build/bin/). CUDA code builds whenever
# nvcc is found (/usr/local/cuda/bin/nvcc); BURST_CUDA=OFF skips it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BURST_BUILD_DIR:-$root/build}
jobs=${BURST_JOBS:-$(nproc)}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBURST_CUDA="${BURST_CUDA:-ON}" >/dev/null
cmake --build "$build" -j "$jobs"
echo "build: ok ($build/bin)"
