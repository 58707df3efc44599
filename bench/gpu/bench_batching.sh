#!/usr/bin/env bash
# bench_batching.sh: continuous batching on the GPU machine (2 GPUs or more), from the repository
# root with .devpack carried (bench/gpu/pack.sh BUILD_DIR burst-server burst-worker
# libburst_spm.so [burst_gpu_tests burst-generate] first). Results under $OUT.
#   1. Correctness first: burst_gpu_tests (GPU 0), and the tiny model's greedy text through
#      burst-generate in-process == 1 and 2 NCCL workers (paged decode), and through burst-server
#      on $WORKERS workers in 8-token chunks (chunked ring, pass-KV then pass-Q) == 1 worker.
#   2. 7B preset (random weights, bf16) through burst-server on $WORKERS GPUs (default 2), for each prefill chunk
#      size in $CHUNKS: a 128K-token request alone (TTFT, TPOT), then the head-of-line probe
#      (3 x 100-token requests sent 1 s into a 128K one), then (first chunk size only) decode
#      throughput of 1 and 16 sequences of 2K context.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .devpack/env.sh
export NCCL_NVLS_ENABLE=0 BURST_SOURCE_DIR=$PWD OMP_WAIT_POLICY=PASSIVE
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
if command -v burst_gpu_tests > /dev/null; then
  timeout 400 burst_gpu_tests --gtest_brief=1 > "$out/gpu_tests.txt" 2>&1 || status=1
  tail -4 "$out/gpu_tests.txt"
fi
if command -v burst-generate > /dev/null; then
  v=(--model models/kjv-tiny --prompt "In the beginning God created the heaven and the earth. And the earth was without form" --max-tokens 24 --temperature 0 --device cuda)
  ref=$(timeout 120 burst-generate "${v[@]}" 2> "$out/gen_inproc.err")
  for n in 1 2; do
    got=$(timeout 200 burst-generate "${v[@]}" --workers "$n" 2> "$out/gen_$n.err")
    [ "$got" = "$ref" ] && echo "tiny model, $n NCCL workers == in-process" \
      || { echo "tiny model, $n workers DIFFERENT: $got vs $ref"; status=1; }
  done | tee "$out/invariance.txt"
fi
py=$(command -v python3)
# Chunked ring prefill over NCCL (pass-KV for the first chunk, pass-Q once the prefix is
# larger): the tiny model's greedy tokens through 2 workers with 8-token chunks against 1 worker,
# whole prompt. bf16 on the GPU: the two may part only where exact arithmetic nearly ties, i.e.
# where the fp32 CPU run (same binaries, --device cpu) agrees with both up to there and has
# both tokens as its top two within 0.1 nats; anywhere else is a failure.
tiny_run() {  # WORKERS CHUNK [DEVICE]: greedy completion with top-2 logprobs, JSON on stdout
  local pf="$out/tiny_ports_$1_$2.json" pid
  rm -f "$pf"
  burst-server --model models/kjv-tiny --device "${3:-cuda}" --workers "$1" --prefill-chunk "$2" \
    --http-port 0 --grpc-port -1 --port-file "$pf" > "$out/tiny_server_$1_$2.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do [ -s "$pf" ] && break; sleep 0.2; done
  [ -s "$pf" ] && "$py" - "$pf" <<'PYEOF'
import json, sys, time, urllib.request
port = json.load(open(sys.argv[1]))["http_port"]
verse = ("In the beginning God created the heaven and the earth. And the earth was without form, "
         "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
         "the face of the waters. And God said, Let there be light: and there was light.")
body = json.dumps({"model": "kjv-tiny", "prompt": verse, "max_tokens": 24, "temperature": 0,
                   "logprobs": 2}).encode()
for _ in range(100):
    try:
        r = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body,
            {"Content-Type": "application/json"}), timeout=60)
        print(json.dumps(json.load(r)["choices"][0])); break
    except Exception as e:  # not ready yet
        err = e; time.sleep(0.3)
else:
    print(json.dumps({"error": str(err)}))
PYEOF
  kill "$pid"; wait "$pid" 2>/dev/null
}
if [ "${WORKERS:-2}" -gt 1 ]; then
  tiny_run 1 4096 > "$out/tiny_whole.json"
  tiny_run "${WORKERS:-2}" 8 > "$out/tiny_chunked.json"
  tiny_run 1 4096 cpu > "$out/tiny_cpu.json"
  "$py" - "$out/tiny_whole.json" "$out/tiny_chunked.json" "$out/tiny_cpu.json" "${WORKERS:-2}" <<'PYEOF' \
    | tee -a "$out/invariance.txt" || status=1
import json, sys
ref, got, cpu = (json.load(open(f)) for f in sys.argv[1:4])
label = f"tiny model, {sys.argv[4]} workers in 8-token chunks vs 1 worker whole"
if any("error" in r for r in (ref, got, cpu)):
    print(f"{label}: ERROR {ref.get('error')} {got.get('error')} {cpu.get('error')}"); sys.exit(1)
a, b, c = (r["logprobs"]["tokens"] for r in (ref, got, cpu))
i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
if i is None:
    print(f"{label}: same {len(a)} tokens: {got['text']!r}"); sys.exit(0)
top = sorted(cpu["logprobs"]["top_logprobs"][i].items(), key=lambda kv: -kv[1]) \
    if len(c) > i and c[:i] == a[:i] else []
gap = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
ok = gap < 0.1 and {a[i], b[i]} <= dict(top).keys()
print(f"{label}: same first {i} tokens, then {a[i]!r} vs {b[i]!r}; the fp32 CPU run "
      + (f"has them {gap:.3f} nats apart: {'a near-tie' if ok else 'DIFFERENT'}" if top
         else "parted earlier: DIFFERENT"))
sys.exit(0 if ok else 1)
PYEOF
fi
for chunk in ${CHUNKS:-4096 8192 16384 32768 131072}; do
  ports="$out/ports_$chunk.json"
  rm -f "$ports"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((${WORKERS:-2} - 1))) burst-server --preset 7b --random-weights 0 \
    --tokenizer models/kjv-tiny/tokenizer.model --device cuda --workers "${WORKERS:-2}" \
    --max-context 140000 --kv-capacity "${KV:-360000}" --max-tokens-limit 1024 \
    --prefill-chunk "$chunk" --http-port 0 --grpc-port -1 --port-file "$ports" \
    > "$out/server_$chunk.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    [ -f "$ports" ] && curl -sf "http://127.0.0.1:$("$py" -c "import json;print(json.load(open('$ports'))['http_port'])")/health" > /dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  if ! kill -0 $server 2>/dev/null; then echo "server (chunk $chunk) died"; tail -5 "$out/server_$chunk.log"; status=1; continue; fi
  # Warm-up (cuBLAS plans, NCCL), then the long request alone, then head-of-line.
  timeout 120 "$py" bench/gpu/hol.py --port-file "$ports" hol --long 8192 --long-out 4 --short-n 0 > /dev/null
  timeout 200 "$py" bench/gpu/hol.py --port-file "$ports" hol --long 131072 --long-out 64 --short-n 0 \
    | tee "$out/alone_$chunk.json"
  timeout 200 "$py" bench/gpu/hol.py --port-file "$ports" hol --long 131072 --long-out 32 \
    --short 100 --short-n 3 --short-out 16 --delay 1.0 | tee "$out/hol_$chunk.json"
  if [ "$chunk" = "$(echo "${CHUNKS:-4096 8192 16384 32768 131072}" | awk '{print $1}')" ]; then
    for c in 1 16; do
      timeout 200 "$py" bench/gpu/hol.py --port-file "$ports" decode --prompt 2048 --out 128 \
        --conc "$c" | tee "$out/decode_$c.json" | cut -c1-160
    done
  fi
  kill $server; wait $server
  grep -E "error|warn" "$out/server_$chunk.log" | head -5
done
exit $status
