#!/usr/bin/env bash
# run_multi_gpu.sh: the multi-GPU run (issue 15) in one call, on a 4- or 8-GPU machine (any
# count N = nvidia-smi -L). From the repository root with .devpack carried. Results under $OUT.
#   1. Invariance: the tiny model's greedy text on 1 GPU in-process and through 1, 2, 4, N
#      workers (NCCL ring); the 7B preset's greedy tokens in-process vs N workers.
#   2. burst-bench-ring at the 7B attention shape on 4 and N GPUs (ring, compute alone, hop,
#      exposed communication).
#   3. 7B preset TTFT and decode speed through burst-generate, one run per entry of TTFT_RUNS
#      ("GPUS:TOKENS[:CHUNK]", CHUNK = --prefill-chunk). The ring's exposed communication on
#      GPUs is step 2's (events); burst-generate's own figure is host-clock, CPU only.
#   4. The baseline in the same call: HF transformers 7B prefill at HF_LEN on one GPU.
#   5. Chunked prefill on N GPUs: burst-bench-ring --chunk (every chunk by pass-KV, then by
#      pass-Q, whose partials go back to non-neighbours on 3+ GPUs; exit 1 if they differ).
# STEPS selects (default all, in this order): golden gputests peergather invtiny inv7b ring
#   ringchunk ttft server hf
#   peergather: the decode exchange by peer stores on every GPU (PeerGather.* tests, up to 8)
#   server: burst-server (7B preset, N GPUs) under burst-bench: bench/gpu/bench_server.sh
#           with the kind h200xN (one request at a time by length, then the mixed load)
#   golden: scripts/make_golden.py for the tiny model (HF transformers), to $OUT/kjv_golden.json
#   gputests: burst_gpu_tests on GPU 0
# OUT_TAR=1 (default) ends by packing everything under $OUT into $OUT/results.tgz (the device
# tool brings back at most 8 files a call); OUT_TAR=0 leaves the files as they are.
set -uo pipefail
STEPS=${STEPS:-golden gputests peergather invtiny inv7b ring ringchunk ttft server hf}
want() { [[ " $STEPS " == *" $1 "* ]]; }
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
n=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | tee "$out/gpu.txt"
status=0
verse="In the beginning God created the heaven and the earth. And the earth was without form"
gen() { timeout "${GEN_TIMEOUT:-600}" burst-generate --device cuda --temperature 0 "$@"; }
upto_n() { printf '%s\n' "$@" | sort -nu | awk -v n="$n" '$1 <= n'; }  # GPU counts <= n, once

if want golden; then
  timeout 120 python3 scripts/make_golden.py /tmp/golden --only kjv-tiny > "$out/golden.log" 2>&1 \
    && cp /tmp/golden/kjv-tiny/golden.json "$out/kjv_golden.json" || status=1
  tail -2 "$out/golden.log"
fi
if want gputests; then
  BURST_SOURCE_DIR=$PWD CUDA_VISIBLE_DEVICES=0 timeout 300 burst_gpu_tests > "$out/gpu_tests.log" 2>&1 || status=1
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) " "$out/gpu_tests.log" | tail -40
fi
if want peergather; then
  timeout 300 burst_gpu_tests --gtest_filter='PeerGather.*' > "$out/peer_gather.log" 2>&1 || status=1
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |rank" "$out/peer_gather.log" | tail -10
fi
if want invtiny; then
ref=$(gen --model models/kjv-tiny --prompt "$verse" --max-tokens 24 2> "$out/tiny_inproc.err")
echo "tiny, 1 GPU in-process: $ref" | tee "$out/invariance.txt"
for w in $(upto_n 1 2 4 "$n"); do
  got=$(gen --model models/kjv-tiny --prompt "$verse" --max-tokens 24 --workers "$w" \
        2> "$out/tiny_${w}.err")
  [ "$got" = "$ref" ] && v=same || { v=DIFFERENT; status=1; }
  echo "tiny, $w workers: $v: $got" | tee -a "$out/invariance.txt"
done
fi
if want inv7b; then
ref=$(gen --preset 7b --random-weights 0 --prompt-tokens 8191 --max-tokens 12 2> /dev/null)
got=$(gen --preset 7b --random-weights 0 --prompt-tokens 8191 --max-tokens 12 --workers "$n" \
      2> "$out/7b_inv.err")
[ "$got" = "$ref" ] && v=same || { v=DIFFERENT; status=1; }
echo "7B preset 8191 tokens: 1 GPU: $ref | $n workers ($v): $got" | tee -a "$out/invariance.txt"
fi

want ring && for w in $(upto_n 4 "$n"); do
  seqs=${RING_SEQS:-65536,131072,262144,524288}
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((w - 1))) timeout 300 burst-bench-ring --world "$w" \
    --seq "$seqs" --reps 3 --out "$out/ring_${w}.json" 2>&1 | tee "$out/ring_${w}.txt"
done

if want ringchunk; then
  timeout 300 burst-bench-ring --world "$n" --seq "${RING_CHUNK_SEQS:-131072}" \
    --chunk "${RING_CHUNK:-8192}" --reps 3 2>&1 | tee "$out/ring_chunked_${n}.txt" || status=1
fi

ttft() {  # workers, tokens, chunk (0: the whole prompt in one pass)
  local tag="${1}_${2}" extra=() what=""
  [ "${3:-0}" -gt 0 ] && { extra=(--prefill-chunk "$3"); tag="${tag}_c$3"; what=" chunk $3"; }
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(($1 - 1))) gen --preset 7b --random-weights 0 \
    --workers "$1" --prompt-tokens "$2" --max-tokens "${TTFT_TOKENS:-16}" "${extra[@]}" \
    > /dev/null 2> "$out/ttft_$tag.err"
  echo "7B, $1 GPUs, $2 tokens$what: $(grep -h 'prefill (TTFT)' "$out/ttft_$tag.err" \
        | tr '\n' ' ' || tail -2 "$out/ttft_$tag.err")" | tee -a "$out/ttft.txt"
}
if want ttft; then
  # Default: scaling 1 -> 2 -> 4 (-> 8) at 128K and 256K, 4 GPUs to 768K (in 3 chunks: whole,
  # by estimate a rank's activations would not fit beside its KV on an H200), 8 GPUs to 1M.
  def="1:131072 2:131072 2:262144 4:131072 4:262144 4:524288 4:786432:262144"
  [ "$n" -ge 8 ] && def+=" $n:131072 $n:262144 $n:524288 $n:1048576"
  # shellcheck disable=SC2086  # the runs are words
  for r in $(printf '%s\n' ${TTFT_RUNS:-$def} | awk '!seen[$0]++'); do
    IFS=: read -r w s c <<< "$r"
    [ "$w" -le "$n" ] && ttft "$w" "$s" "${c:-0}"
  done
fi
if want server; then
  OUT=$out bash bench/gpu/bench_server.sh "h200x$n" || status=1
fi
if want hf; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/gpu/hf_prefill.py --lengths "${HF_LEN:-65536}" \
    --reps 1 --out "$out/hf.jsonl" > "$out/hf.log" 2>&1
  tail -3 "$out/hf.log"; cat "$out/hf.jsonl"
fi
if [ "${OUT_TAR:-1}" = 1 ]; then
  tar -czf /tmp/run_multi_gpu_results.tgz -C "$out" . && find "$out" -mindepth 1 -delete &&
    mv /tmp/run_multi_gpu_results.tgz "$out/results.tgz"
fi
exit $status
