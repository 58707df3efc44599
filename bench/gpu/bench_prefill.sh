#!/usr/bin/env bash
# bench_prefill.sh: single-GPU prefill (TTFT) of the 7B preset, burst against HF transformers.
# On the GPU machine, from the repository root, with .devpack carried (bench/gpu/pack.sh
# BUILD_DIR first):
#   bench/gpu/bench_prefill.sh            # LENGTHS=4096,16384,32768,65536 REPS=3
# 1. burst, warm: the GPU test binary's CudaPrefillBench (runtime::generate (one-rank LocalStepRunner) with max_tokens 1,
#    exactly what burst-generate times as TTFT; one warm-up, median of REPS, one process).
# 2. burst-generate --device cuda, one cold process per length (model init, cuBLAS and kernel
#    loading included in the first forward): the CLI path end to end.
# 3. HF transformers (bench/gpu/hf_prefill.py), then the ratio table (printed last).
# Results go under $OUT (or ./gpu-out). Each step is bounded by STEP_TIMEOUT seconds.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
lengths=${LENGTHS:-4096,16384,32768,65536}
reps=${REPS:-3}
step_timeout=${STEP_TIMEOUT:-240}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total \
  --format=csv,noheader > "$out/prefill_gpu.txt" 2>&1
cat "$out/prefill_gpu.txt"

BURST_BENCH_PREFILL=$lengths BURST_BENCH_REPS=$reps BURST_BENCH_OUT="$out/prefill_ours.jsonl" \
  timeout "$step_timeout" burst_gpu_tests --gtest_filter='CudaPrefillBench.*' \
  > "$out/prefill_ours.log" 2>&1 || status=1
grep -E "info|OK|FAILED|Failure|error" "$out/prefill_ours.log"

: > "$out/prefill_cli.txt"
for n in ${lengths//,/ }; do
  line=$(timeout "$step_timeout" burst-generate --preset 7b --random-weights 0 \
    --prompt-tokens "$n" --max-tokens 1 --temperature 0 --device cuda 2>&1 >/dev/null \
    | grep "TTFT") || { echo "burst-generate $n failed"; status=1; continue; }
  echo "$line"
  ms=$(echo "$line" | sed -E 's/.*prefill \(TTFT\) ([0-9.]+) ms.*/\1/')
  echo "$n $ms" >> "$out/prefill_cli.txt"
done

timeout "$step_timeout" python3 bench/gpu/hf_prefill.py --lengths "$lengths" --reps "$reps" \
  --out "$out/prefill_hf.jsonl" 2>&1 | grep -v Warning | tee "$out/prefill_hf.log" || status=1

python3 bench/gpu/hf_prefill.py --report "$out/prefill_ours.jsonl" "$out/prefill_hf.jsonl" \
  --cli "$out/prefill_cli.txt" | tee "$out/prefill_table.md"
exit $status
