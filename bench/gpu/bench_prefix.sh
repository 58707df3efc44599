#!/usr/bin/env bash
# bench_prefix.sh [WORKERS]: prefix caching on the GPU machine (issue 40's numbers). From the
# repository root with .devpack carried (bench/gpu/pack.sh BUILD_DIR first). burst-server on
# WORKERS GPUs (default 4) with the 7B preset (random weights), once with prefix caching and
# once with --no-prefix-caching, each driven by bench/gpu/bench_prefix.py (a DOC-token
# document, then questions one at a time and CONCURRENCY at once, then a growing chat), then by
# burst-bench's prefix-repetition workload (PREFIXES documents of PREFIX_LEN tokens, SUFFIX_LEN-
# token questions, PROMPTS requests at RATE req/s, Poisson; goodput TTFT <= 1 s, TPOT <= 50 ms).
# DOC (default 131072), QUESTIONS (20), TURNS (10), TURN_TOKENS (6400), KV (tokens; default
# 0: from the GPUs' memory), MODES ("on off"). Results under $OUT: prefix_{on,off}.{txt,json}, server_*.log.
set -uo pipefail
workers=${1:-4}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
doc=${DOC:-131072}
ctx=$((doc + 8192))
for mode in ${MODES:-on off}; do
  flags=()
  [ "$mode" = off ] && flags=(--no-prefix-caching)
  ports=$(mktemp -d)/ports.json
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) burst-server --preset 7b --random-weights 0 \
    --device cuda --workers "$workers" --tokenizer models/kjv-tiny/tokenizer.model \
    --max-context "$ctx" --kv-capacity "${KV:-0}" --max-queue 1024 \
    --http-port 0 --grpc-port -1 --port-file "$ports" "${flags[@]}" \
    > "$out/server_prefix_$mode.log" 2>&1 &
  server=$!
  timeout "${STEP_TIMEOUT:-420}" python3 bench/gpu/bench_prefix.py "$ports" --doc "$doc" \
    --questions "${QUESTIONS:-20}" --concurrency "${CONCURRENCY:-8}" --turns "${TURNS:-10}" \
    --turn-tokens "${TURN_TOKENS:-6400}" --json "$out/prefix_$mode.json" \
    2>&1 | tee "$out/prefix_$mode.txt"
  url=http://127.0.0.1:$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['http_port'])" "$ports")
  timeout "${STEP_TIMEOUT:-420}" python3 bench/burst_bench.py --base-url "$url" --no-progress \
    --dataset-name prefix-repetition --prefix-repetition-prefix-len "${PREFIX_LEN:-32768}" \
    --prefix-repetition-suffix-len "${SUFFIX_LEN:-200}" \
    --prefix-repetition-num-prefixes "${PREFIXES:-4}" --prefix-repetition-output-len 32 \
    --ignore-eos --num-prompts "${PROMPTS:-48}" --request-rate "${RATE:-1}" --seed 1 \
    --goodput ttft:1000 tpot:50 --label "prefix-repetition $mode" \
    --result-json "$out/prefix_repetition_$mode.json" 2>&1 | tee "$out/prefix_repetition_$mode.txt"
  kill -TERM $server 2>/dev/null
  wait $server 2>/dev/null
done
