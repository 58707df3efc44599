#!/usr/bin/env bash
# bench_tp.sh: tensor parallelism x the BurstAttention ring on one 4-GPU host, in one call.
# From the repository root with .devpack carried (bench/gpu/pack.sh BUILD_DIR first).
# Results under $OUT (or ./gpu-out). STEPS selects (default all, in this order):
#   gputests  burst_gpu_tests on GPU 0 (the random window kernel against the CPU's, ...)
#   peergather  the PeerGather tests on every GPU: the decode exchange and NCCL's all_reduce_sum
#   invtiny   the tiny model's greedy text in-process on one GPU and through tp 2, tp 2 x cp 2
#   inv7b     the 7B preset's greedy tokens (INV_LEN-token prompt): in-process on one GPU, tp 4,
#             tp 2 x cp 2, cp 4 (bf16 sums in another order: the agreeing prefix is reported)
#   peak      the bf16 matmul peak one GPU reaches (torch, cuBLAS, 8192^3): MFU's denominator
#   tp70      the 70B preset on 4 GPUs at tp 4: TTFT and decode at each of LENGTHS_70B
#   layouts   7B and 13B at LAYOUT_LEN on 4 GPUs: cp 4, tp 2 x cp 2, tp 4
# Every burst-generate line ("prefill (TTFT) ... decode ... tok/s") goes to $OUT/tp.txt.
set -uo pipefail
STEPS=${STEPS:-gputests peergather invtiny inv7b peak tp70 layouts}
want() { [[ " $STEPS " == *" $1 "* ]]; }
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | head -1 \
  | tee "$out/gpu.txt"
status=0
gen() { timeout "${GEN_TIMEOUT:-420}" burst-generate --device cuda --temperature 0 "$@"; }
record() {  # LABEL ARGS...: one run, its stats line into tp.txt
  local label=$1; shift
  local line
  line=$(gen "$@" 2>&1 >/dev/null | grep -E "TTFT|error") || true
  [[ "$line" == *TTFT* ]] || status=1
  echo "$label | $line" | tee -a "$out/tp.txt"
}

if want gputests; then
  BURST_SOURCE_DIR=$PWD CUDA_VISIBLE_DEVICES=0 timeout 300 burst_gpu_tests \
    > "$out/gpu_tests.log" 2>&1 || status=1
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) " "$out/gpu_tests.log" | tail -12
fi
if want peergather; then
  timeout 300 burst_gpu_tests --gtest_filter='PeerGather.*' > "$out/peer_gather.log" 2>&1 || status=1
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |rank" "$out/peer_gather.log" | tail -10
fi
if want invtiny; then
  verse="In the beginning God created the heaven and the earth. And the earth was without form"
  ref=$(gen --model models/kjv-tiny --prompt "$verse" --max-tokens 24 2>/dev/null)
  echo "tiny, in-process: $ref" | tee "$out/invariance.txt"
  for layout in "2 2" "4 2"; do
    set -- $layout
    got=$(gen --model models/kjv-tiny --prompt "$verse" --max-tokens 24 --workers "$1" --tp "$2" \
          2> "$out/tiny_w$1_tp$2.err")
    [ "$got" = "$ref" ] && v=same || { v=DIFFERENT; status=1; }
    echo "tiny, $1 workers tp $2: $v: $got" | tee -a "$out/invariance.txt"
  done
fi
if want inv7b; then
  len=${INV_LEN:-4096}
  ref=$(gen --preset 7b --random-weights 1 --prompt-tokens "$len" --max-tokens 32 2>/dev/null)
  echo "7b in-process: $ref" | tee -a "$out/invariance.txt"
  for layout in "4 4" "4 2" "4 1"; do
    set -- $layout
    got=$(gen --preset 7b --random-weights 1 --prompt-tokens "$len" --max-tokens 32 \
          --workers "$1" --tp "$2" 2> "$out/inv7b_w$1_tp$2.err")
    same=$(python3 -c "import sys; a=sys.argv[1].split(); b=sys.argv[2].split(); \
n=next((i for i,(x,y) in enumerate(zip(a,b)) if x!=y), min(len(a),len(b))); print(n, 'of', len(a))" \
      "$ref" "$got")
    echo "7b $1 workers tp $2: first $same tokens agree: $got" | tee -a "$out/invariance.txt"
  done
fi
if want peak; then
  timeout 120 python3 - <<'PY' 2>&1 | tee "$out/peak.txt"
import torch, time
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5): a @ b
torch.cuda.synchronize()
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    for _ in range(20): a @ b
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter() - t) / 20)
print(f"matmul peak bf16 {n}^3: {2 * n**3 / best / 1e12:.0f} TFLOP/s per GPU")
PY
fi
if want tp70; then
  for n in ${LENGTHS_70B:-32768 65536 131072}; do
    record "70b tp 4, $n tokens" --preset 70b --random-weights 1 --prompt-tokens "$n" \
      --max-tokens 33 --workers 4 --tp 4
  done
fi
if want layouts; then
  n=${LAYOUT_LEN:-131072}
  for preset in 7b 13b; do
    for layout in "4 1" "4 2" "4 4"; do
      set -- $layout
      record "$preset $1 workers tp $2, $n tokens" --preset "$preset" --random-weights 1 \
        --prompt-tokens "$n" --max-tokens 33 --workers "$1" --tp "$2"
    done
  done
fi
exit $status
