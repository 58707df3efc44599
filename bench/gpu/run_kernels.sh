#!/usr/bin/env bash
# run_kernels.sh: on the GPU machine, from the repository root, with .devpack carried
# (bench/gpu/pack.sh BUILD_DIR first). Runs the GPU kernel tests, our kernel benchmark and
# the torch SDPA baseline, then the same prefill shapes timed launch by launch beside torch's
# cuDNN and FlashAttention-2 and the mma.sync ceiling in one process (bench_interleaved.py:
# the numbers issue 14's ratios are taken from; on an A100 its "auto" rows are the sm_80
# kernel), writes everything under $OUT (or ./gpu-out).
#   bench/gpu/run_kernels.sh [bench args, e.g. --sizes 4096]
# TEST_TIMEOUT / BENCH_TIMEOUT (seconds) bound each step so the whole stays inside a lease.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# Which instructions the attention kernels compiled to (HMMA, HGMMA: tensor cores; LDSM: ldmatrix;
# LDGSTS: cp.async; LDL/STL: local-memory spills), from the binary that runs here.
if command -v cuobjdump > /dev/null; then
  cuobjdump --dump-sass .devpack/bin/burst-bench-kernels 2>/dev/null | awk '
    /Function :/ { name = $3 } /arch = sm_/ { arch = $3 }
    /HMMA|HGMMA/ { h[name " " arch]++ } /LDSM/ { l[name " " arch]++ } /LDGSTS/ { g[name " " arch]++ }
    /LDL|STL/ { s[name " " arch]++ }
    END { for (n in h) printf "sass %s: HMMA %d LDSM %d LDGSTS %d LDL/STL %d\n", n, h[n], l[n],
          g[n], s[n] }' | grep -i "attention" | sort | tee "$out/sass.txt"
fi
status=0
BURST_SOURCE_DIR=$PWD timeout "${TEST_TIMEOUT:-300}" burst_gpu_tests --gtest_output="xml:$out/gpu_tests.xml" \
  > "$out/gpu_tests.log" 2>&1 || status=1
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) " "$out/gpu_tests.log"
grep -E -A7 "Failure$" "$out/gpu_tests.log" | head -80
timeout "${BENCH_TIMEOUT:-150}" burst-bench-kernels --out "$out/bench_kernels.json" "$@" 2>&1 \
  | tee "$out/bench.log" || status=1
timeout "${BENCH_TIMEOUT:-150}" python3 bench/gpu/bench_kernels.py \
  --ours "$out/bench_kernels.json" --out "$out/bench_torch.json" 2>&1 \
  | tee "$out/bench_torch.log" || status=1
kernels=auto
# On Hopper "auto" is the wgmma kernel: time the mma.sync one (what an A100 runs) beside it.
python3 -c "import torch, sys; sys.exit(torch.cuda.get_device_capability()[0] < 9)" 2>/dev/null \
  && kernels=auto,sm80
timeout "${BENCH_TIMEOUT:-150}" python3 bench/gpu/bench_interleaved.py \
  --lib .devpack/bin/libburst_attn.so --kernels "$kernels" --sizes 4096,16384,65536 \
  --head-dims 128,64 --rounds 8 --decode-sizes 131072 --decode-kv-heads 8 --mma-peak \
  --out "$out/interleaved.json" 2>&1 | tee "$out/interleaved.log" || status=1
exit $status
