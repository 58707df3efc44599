#!/usr/bin/env bash
# bench_prefix.sh [WORKERS]: prefix caching on the GPU machine (issue 40's numbers). From the
# repository root with .devpack carried (scripts/gpu/pack.sh BUILD_DIR first). burst-server on
# WORKERS GPUs (default 4) with the 7B preset (random weights), once with prefix caching and
# once with --no-prefix-caching, each driven by scripts/gpu/bench_prefix.py (a DOC-token
# document, then questions one at a time and CONCURRENCY at once, then a growing chat).
# DOC (default 131072), QUESTIONS (20), TURNS (10), TURN_TOKENS (6400), KV (tokens; default
# 0: from the GPUs' memory). Results under $OUT: prefix_{on,off}.{txt,json}, server_*.log.
set -uo pipefail
workers=${1:-4}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
doc=${DOC:-131072}
ctx=$((doc + 8192))
for mode in on off; do
  flags=()
  [ "$mode" = off ] && flags=(--no-prefix-caching)
  ports=$(mktemp -d)/ports.json
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) burst-server --preset 7b --random-weights 0 \
    --device cuda --workers "$workers" --tokenizer models/kjv-tiny/tokenizer.model \
    --max-context "$ctx" --kv-capacity "${KV:-0}" --max-queue 1024 \
    --http-port 0 --grpc-port -1 --port-file "$ports" "${flags[@]}" \
    > "$out/server_prefix_$mode.log" 2>&1 &
  server=$!
  timeout "${STEP_TIMEOUT:-420}" python3 scripts/gpu/bench_prefix.py "$ports" --doc "$doc" \
    --questions "${QUESTIONS:-20}" --concurrency "${CONCURRENCY:-8}" --turns "${TURNS:-10}" \
    --turn-tokens "${TURN_TOKENS:-6400}" --json "$out/prefix_$mode.json" \
    2>&1 | tee "$out/prefix_$mode.txt"
  kill -TERM $server 2>/dev/null
  wait $server 2>/dev/null
done
