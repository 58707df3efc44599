#!/usr/bin/env bash
# run_kernels.sh: on the GPU machine, from the repository root, with .devpack carried
# (scripts/gpu/pack.sh BUILD_DIR first). Runs the GPU kernel tests, our kernel benchmark and
# the torch SDPA baseline, writes everything under $OUT (or ./gpu-out) and prints the ratio
# table last.
#   source .devpack/env.sh && scripts/gpu/run_kernels.sh [bench args, e.g. --sizes 4096]
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
status=0
burst_gpu_tests --gtest_output="xml:$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1 || status=1
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |Failure|error" "$out/gpu_tests.log" | head -60
burst-bench-kernels --out "$out/bench_kernels.json" "$@" 2>&1 | tee "$out/bench.log" || status=1
python3 scripts/gpu/bench_kernels.py --ours "$out/bench_kernels.json" \
  --out "$out/bench_torch.json" 2>&1 | tee "$out/bench_torch.log" || status=1
exit $status
