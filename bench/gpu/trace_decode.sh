#!/usr/bin/env bash
# trace_decode.sh PACK: a GPU timeline of burst-server's decode steps (7B preset, random
# weights) through libburst_ktrace.so (bench/ktrace.cpp, CUPTI; the pack must hold it and
# libcupti.so), then bench/gpu/ktrace_report.py on every worker's file. One server start per
# prompt length in PROMPTS (default "2048 131072"); each decodes TOKENS (default 64) tokens after a
# warm-up request. WORKERS (default 2) GPUs; API=1 adds the host's runtime-API calls to the
# timeline; SERVER_FLAGS go to the server. Files land in TRACE_DIR (default /tmp/ktrace); the
# reports are printed. From the repository root on the GPU machine.
set -u
[ $# -eq 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
workers=${WORKERS:-2}
out=${TOKENS:-64}  # not OUT: the device tool's output folder
dir=${TRACE_DIR:-/tmp/ktrace}
mkdir -p /tmp/trace_pack && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" /tmp/trace_pack
source /tmp/trace_pack/.devpack/env.sh
for p in ${PROMPTS:-2048 131072}; do
  rm -rf "$dir/$p" && mkdir -p "$dir/$p"
  pf=/tmp/trace_ports.json; rm -f "$pf"
  CUDA_INJECTION64_PATH=/tmp/trace_pack/.devpack/bin/libburst_ktrace.so BURST_KTRACE_DIR="$dir/$p" \
  BURST_KTRACE_API=${API:-0} CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) \
    burst-server --preset 7b --random-weights 0 --tokenizer models/kjv-tiny/tokenizer.model \
      --device cuda --workers "$workers" --max-context $((p + out + 1024)) --kv-capacity 0 \
      --http-port 0 --grpc-port -1 --port-file "$pf" ${SERVER_FLAGS:-} > "$dir/server_$p.log" 2>&1 &
  sp=$!
  for _ in $(seq 600); do
    kill -0 "$sp" 2> /dev/null || { echo "the server exited:"; tail -5 "$dir/server_$p.log"; exit 1; }
    [ -s "$pf" ] && curl -sf "http://127.0.0.1:$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['http_port'])" "$pf")/health" > /dev/null && break
    sleep 0.3
  done
  timeout 120 python3 bench/gpu/hol.py --port-file "$pf" decode --prompt 2048 --out 16 --conc 1 > /dev/null
  timeout 300 python3 bench/gpu/hol.py --port-file "$pf" decode --prompt "$p" --out "$out" --conc 1 \
    | python3 -c "import json,sys;d=json.load(sys.stdin);print('prompt $p: client ITL %.3f ms'%d['mean_itl_ms'])"
  grep -o 'decode [0-9.]* ms for [0-9]* tokens' "$dir/server_$p.log" | tail -1 \
    | awk '{printf "server: %s ms / %s tokens = TPOT %.3f ms\n", $2, $5, $2 / ($5 - 1)}'
  sleep 0.5
  kill "$sp"; wait "$sp"
  python3 bench/gpu/ktrace_report.py "$dir/$p"/*.tsv --last $((out - 8))
done
