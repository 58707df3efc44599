#!/usr/bin/env bash
# bench_server.sh KIND: burst-server under load from burst-bench on the GPU machine, one command
# per machine kind. From the repository root, with .devpack carried (bench/gpu/pack.sh
# BUILD_DIR first); the server is the 7B preset with random weights (--preset 7b
# --random-weights 0, bf16, no files), HTTP only (the GPU machine's python has no grpcio, and
# burst-bench needs nothing but the standard library over HTTP).
#   bench/gpu/bench_server.sh h100     # 1 worker:  4K, 16K, 32K, 64K
#   bench/gpu/bench_server.sh h200     # 1 worker:  32K, 64K, 128K
#   bench/gpu/bench_server.sh h200x2   # 2 workers: 32K, 64K, 128K, 256K, then the mixed
#                                        # workload: 10% 128K / 90% 2K prompts, Poisson arrivals
#   bench/gpu/bench_server.sh h200x4   # 4 workers: 128K, 256K, 512K, then the mixed workload
#   bench/gpu/bench_server.sh h200x8   # 8 workers: 128K, 256K, 512K, 1M, then the mixed one
# Each length: REQS requests (default 3) one at a time (the first length after one warm-up),
# random token ids (exact lengths), OUTPUT_LEN tokens (default 32, --ignore-eos). Mixed:
# MIXED_REQS (50) requests at MIXED_RATE (0.5) req/s, no concurrency limit.
# Results under $OUT (default ./gpu-out): bench_KIND_<point>.json (burst-bench --result-json,
# vLLM field names), bench_KIND_table.md, bench_KIND_plots/, bench_KIND_server.log.
# LENGTHS (comma list) overrides the lengths; KV the KV capacity in tokens (default per kind,
# at least the longest prompt); MIXED=1 adds the mixed workload on any kind;
# STEP_TIMEOUT (s, default 300) bounds each point. PRESET names another preset (e.g. 70b, with
# SERVER_FLAGS="--tp 4"). SERVER_FLAGS adds burst-server flags and TAG
# names the run in the file names (e.g. SERVER_FLAGS="--max-running 1 --prefill-chunk 262144"
# TAG=serial: one request at a time, whole prompts: the server before continuous batching).
# LAYOUT=1 (default on h200x2) ends with burst-generate at 128K, zigzag against contiguous.
set -uo pipefail
kind=${1:-}
# def_kv: KV capacity in tokens, what the GPUs hold beside the weights (the 7B's KV is 512 KiB
# a token): room for a long prompt and the short ones that arrive meanwhile (with the capacity
# of one long prompt, short ones wait in the queue for it).
case "$kind" in
  h100) workers=1; def_lengths=4096,16384,32768,65536; mixed=0; def_kv=110000 ;;
  h200) workers=1; def_lengths=32768,65536,131072; mixed=0; def_kv=200000 ;;
  h200x2) workers=2; def_lengths=32768,65536,131072,262144; mixed=1; def_kv=400000 ;;
  h200x4) workers=4; def_lengths=131072,262144,524288; mixed=1; def_kv=600000 ;;
  h200x8) workers=8; def_lengths=131072,262144,524288,1048576; mixed=1; def_kv=1200000 ;;
  *) sed -n '2,23p' "$0" >&2; exit 2 ;;
esac
lengths=${LENGTHS:-$def_lengths}
layout=${LAYOUT:-$mixed}
[ -n "${TAG:-}" ] && kind="${kind}_$TAG"
mixed=${MIXED:-$mixed}
out=${OUT:-$PWD/gpu-out}
reqs=${REQS:-3}
output_len=${OUTPUT_LEN:-32}
step_timeout=${STEP_TIMEOUT:-300}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export BURST_SOURCE_DIR=${BURST_SOURCE_DIR:-$PWD} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
bench=(python3 "$BURST_SOURCE_DIR/bench/burst_bench.py")
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge "$workers" ] || { echo "bench_server: $kind needs $workers GPUs, found $gpus" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | tee "$out/bench_${kind}_gpu.txt"

# The context and the KV capacity: the longest prompt of the run plus its output and slack.
max_len=0
for n in ${lengths//,/ }; do [ "$n" -gt "$max_len" ] && max_len=$n; done
[ "$mixed" -eq 1 ] && [ "$max_len" -lt 131072 ] && max_len=131072
ctx=$((max_len + output_len + 64))
kv=${KV:-$def_kv}
[ "$kv" -lt "$ctx" ] && kv=$ctx
ports=$(mktemp -d)/ports.json
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) burst-server --preset "${PRESET:-7b}" --random-weights 0 \
  --device cuda --workers "$workers" --tokenizer models/kjv-tiny/tokenizer.model \
  --max-context "$ctx" --kv-capacity "$kv" --max-queue 1024 \
  --http-port 0 --grpc-port -1 --port-file "$ports" ${SERVER_FLAGS:-} \
  > "$out/bench_${kind}_server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  [ -s "$ports" ] && break
  kill -0 $server 2>/dev/null || { echo "burst-server exited:"; tail -20 "$out/bench_${kind}_server.log"; exit 1; }
  sleep 0.2
done
[ -s "$ports" ] || { echo "bench_server: no port file after 120 s"; exit 1; }
url=http://127.0.0.1:$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['http_port'])" "$ports")
echo "bench_server: $kind, $workers worker(s), ${PRESET:-7b} preset ${SERVER_FLAGS:-}, context $ctx, $url"

status=0
points=()
point() {  # NAME FLAGS...: one burst-bench run
  local name=$1; shift
  local json="$out/bench_${kind}_${name}.json"
  echo "== $name: $*"
  timeout "$step_timeout" "${bench[@]}" --base-url "$url" --wait-ready 600 --no-progress \
    --label "$kind $name" --metadata "machine=$kind" "workers=$workers" \
    --result-json "$json" "$@" > "$out/bench_${kind}_${name}.txt" 2> "$out/bench_${kind}_${name}.err" \
    || { status=1; echo "   failed: $(tail -3 "$out/bench_${kind}_${name}.err")"; }
  grep -E "Successful|Failed requests|Mean TTFT|Median TTFT|Mean TPOT|Mean server prefill|HTTP|timeout" \
    "$out/bench_${kind}_${name}.txt" | sed 's/^/   /'
  [ -s "$json" ] && points+=("$json")
}
warm=1
for n in ${lengths//,/ }; do
  name=len$n
  [ $((n % 1024)) -eq 0 ] && name=len$((n / 1024))k
  point "$name" --input-len "$n" --output-len "$output_len" --ignore-eos \
    --num-requests "$reqs" --max-concurrency 1 --num-warmups "$warm"
  warm=0
done
if [ "$mixed" -eq 1 ]; then
  # Head-of-line blocking: short prompts arriving behind 128K ones (see the per-group TTFTs).
  # Goodput: requests with TTFT <= 1 s and TPOT <= 50 ms (GOODPUT overrides).
  # shellcheck disable=SC2086
  point mixed --input-len 2048 --long-fraction 0.1 --long-len 131072 \
    --output-len "$output_len" --ignore-eos --num-requests "${MIXED_REQS:-50}" \
    --request-rate "${MIXED_RATE:-0.5}" --goodput ${GOODPUT:-ttft:1000 tpot:50}
fi
if [ ${#points[@]} -gt 0 ]; then
  "${bench[@]}" --report "${points[@]}" --markdown "$out/bench_${kind}_table.md" \
    --plot "$out/bench_${kind}_plots" 2>&1 | grep -v "^burst-bench: wrote"
fi
kill -TERM $server; wait $server
trap - EXIT
tail -3 "$out/bench_${kind}_server.log"
if [ "$layout" -eq 1 ] && [ "$workers" -gt 1 ]; then
  # Sequence sharding: zigzag (each rank a front and a back block: equal causal work) against
  # contiguous blocks (the last rank does most of the work), one 128K prompt through the ring.
  for l in zigzag contiguous; do
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) timeout "$step_timeout" burst-generate \
      --preset 7b --random-weights 0 --device cuda --temperature 0 --workers "$workers" \
      --prompt-tokens 131072 --max-tokens 8 --layout "$l" > /dev/null 2> "$out/bench_${kind}_layout_$l.err" \
      || status=1
    echo "layout $l, 128K, $workers GPUs: $(grep -h 'prefill (TTFT)' "$out/bench_${kind}_layout_$l.err" \
      || tail -2 "$out/bench_${kind}_layout_$l.err")" | tee -a "$out/bench_${kind}_layout.txt"
  done
fi
exit $status
