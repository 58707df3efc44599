#!/usr/bin/env bash
# run_ring.sh: on a multi-GPU machine, from the repository root, with .devpack carried
# (bench/gpu/pack.sh BUILD_DIR first). NCCL ring checks and benchmarks, results under $OUT:
#   1. N-invariance: the tiny model's greedy text through burst-generate on 1 GPU in-process and
#      with --workers N (one burst-worker per GPU, NCCL ring) for each N in $WORLDS.
#   2. burst-bench-ring at the 7B attention shape (32 heads x 128, bf16) for each N in $WORLDS
#      at the lengths in $SEQS: ring time, compute alone, one hop, exposed communication.
#   3. TTFT of the 7B preset (random weights) through the workers at $TTFT_SEQS on max(WORLDS).
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
WORLDS=${WORLDS:-"2 $gpus"}
SEQS=${SEQS:-32768,65536,131072}
# INV_ARGS: what the invariance check generates from (default: the tiny model and a verse).
if [ -n "${INV_ARGS:-}" ]; then
  read -r -a inv <<< "$INV_ARGS"
else
  inv=(--model models/kjv-tiny --prompt
       "In the beginning God created the heaven and the earth. And the earth was without form")
fi
status=0
ref=$(timeout 120 burst-generate "${inv[@]}" --device cuda --max-tokens 24 --temperature 0 \
      2> "$out/gen_inproc.err")
tail -1 "$out/gen_inproc.err"
echo "1 GPU in-process: $ref" | tee "$out/invariance.txt"
for n in 1 $WORLDS; do
  got=$(timeout 300 burst-generate "${inv[@]}" --device cuda --workers "$n" \
        --max-tokens 24 --temperature 0 2> "$out/gen_${n}gpu.err")
  if [ "$got" = "$ref" ]; then verdict=same; else verdict=DIFFERENT; status=1; fi
  echo "$n workers: $verdict: $got" | tee -a "$out/invariance.txt"
  tail -2 "$out/gen_${n}gpu.err"
done
for n in $WORLDS; do
  [ "$n" -ge 2 ] || continue
  timeout "${RING_TIMEOUT:-240}" burst-bench-ring --world "$n" --seq "$SEQS" --reps 3 \
    --out "$out/ring_${n}.json" 2>&1 | tee "$out/ring_${n}.txt" || status=1
done
last=$(echo "$WORLDS" | awk '{print $NF}')
for s in ${TTFT_SEQS:-}; do
  timeout 300 burst-generate --preset 7b --random-weights 0 --device cuda --workers "$last" \
    --prompt-tokens "$s" --max-tokens 4 --temperature 0 > /dev/null 2> "$out/ttft_${s}.err" \
    || status=1
  echo "7B preset, $s tokens, $last GPUs: $(grep -h 'prefill' "$out/ttft_${s}.err" | tail -1)" \
    | tee -a "$out/ttft.txt"
done
exit $status
