#!/usr/bin/env bash
# ab_decode.sh PACK... : the same decode workload through burst-server built several ways, on
# one machine in one call, the packs taken in turn twice (A B C A B C: drift hits all alike).
# Per server start, for each PROMPTS length (default "2048"): one sequence decoding TOKENS (default
# 128) tokens alone, RUNS (default 2) times after one warm-up request; prints tok/s and the
# mean inter-token time. PACK is a tar.xz of a .devpack (bench/gpu/pack.sh BUILD burst-server
# burst-worker libburst_spm.so, then tar -cJf X.tar.xz .devpack) carried in a git-ignored
# folder. From the repository root on the GPU machine; WORKERS (default 2) GPUs, PRESET (default
# 7b; random weights); extra server flags in SERVER_FLAGS (e.g. "--tp 2"); ENV_B, if set, is exported for the
# second pack only (e.g. ENV_B=BURST_PDL=0 with the same pack twice), ENV_C for the third, and
# FLAGS_B are server flags for the second only (e.g. FLAGS_B="--prefill-chunk 4096").
# CONC (default 1) sequences decode at once (one batch: the client's tok/s is their sum).
# PREFILLS (e.g. "32768 65536"): after the decode runs, the client's time to first token of
# one streamed request per length, twice (bench/gpu/server_ttft.py), per server start.
set -u
[ $# -ge 1 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
workers=${WORKERS:-2}
prompts=${PROMPTS:-2048}
# TOKENS, or OUT as earlier commands gave it when it is a number (the device tool's $OUT is a
# folder: never a token count).
out=${TOKENS:-128}
if [ -z "${TOKENS:-}" ] && [[ "${OUT:-}" =~ ^[0-9]+$ ]]; then out=$OUT; fi
runs=${RUNS:-2}
longest=0
for p in $prompts ${PREFILLS:-}; do [ "$p" -gt "$longest" ] && longest=$p; done
export NCCL_NVLS_ENABLE=0
i=0
rm -f /tmp/ab_text_*.txt
for pack in "$@"; do
  i=$((i + 1))
  mkdir -p "/tmp/ab$i" && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$pack" "/tmp/ab$i"
done
n=$#
for round in 1 2; do
  for v in $(seq "$n"); do
    name=$(printf "\\x$(printf %x $((64 + v)))")
    ( source "/tmp/ab$v/.devpack/env.sh"
      if [ "$v" = 2 ] && [ -n "${ENV_B:-}" ]; then export "$ENV_B"; fi
      if [ "$v" = 3 ] && [ -n "${ENV_C:-}" ]; then export "$ENV_C"; fi
      flags_b=""
      if [ "$v" = 2 ]; then flags_b=${FLAGS_B:-}; fi
      pf=/tmp/ab_ports_$v.json; rm -f "$pf"
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) burst-server --preset "${PRESET:-7b}" \
        --random-weights 0 \
        --tokenizer models/kjv-tiny/tokenizer.model --device cuda --workers "$workers" \
        --max-context $((longest + out + 1024)) --kv-capacity 0 \
        --http-port 0 --grpc-port -1 --port-file "$pf" ${SERVER_FLAGS:-} $flags_b > "/tmp/ab_server_$v.log" 2>&1 &
      sp=$!
      for _ in $(seq 600); do
        [ -s "$pf" ] && curl -sf "http://127.0.0.1:$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['http_port'])" "$pf")/health" > /dev/null && break
        sleep 0.3
      done
      timeout 120 python3 bench/gpu/hol.py --port-file "$pf" decode --prompt 2048 --out 16 --conc 1 > /dev/null
      for p in $prompts; do
        for r in $(seq "$runs"); do
          # The client's rate counts streamed chunks (a token whose text is empty sends none);
          # the server's own line counts every token: both are printed.
          timeout 300 python3 bench/gpu/hol.py --port-file "$pf" decode --prompt "$p" \
            --out "$out" --conc "${CONC:-1}" \
            | python3 -c "import json,sys;d=json.load(sys.stdin);print('$name round $round prompt $p run $r: %.1f tok/s, ITL %.3f ms'%(d['total_decode_tok_s'],d['mean_itl_ms']),d['errors'] or '',end='; ')"
          grep -o 'decode [0-9.]* ms for [0-9]* tokens' "/tmp/ab_server_$v.log" | tail -1 \
            | awk '{printf "server: %s ms / %s tokens = TPOT %.3f ms\n", $2, $5, $2 / ($5 - 1)}'
        done
      done
      if [ -n "${PREFILLS:-}" ]; then
        # shellcheck disable=SC2086
        timeout 600 python3 bench/gpu/server_ttft.py "$pf" $PREFILLS $PREFILLS \
          | sed "s/^/$name round $round prefill: /"
      fi
      # One greedy answer per server start: the builds (and flags) must agree on the tokens.
      port=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['http_port'])" "$pf")
      curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "In the beginning God created", "max_tokens": 48, "temperature": 0}' \
        | python3 -c "import json,sys;print(json.load(sys.stdin)['choices'][0]['text'])" \
        > "/tmp/ab_text_${v}_$round.txt"
      kill "$sp"; wait "$sp" ) || { echo "$name round $round: failed; the server log's end:"
                                      tail -n 15 "/tmp/ab_server_$v.log"; }
  done
done
# The greedy text of each setting (pack, with its flags and environment) across its two starts,
# then across settings: a setting must agree with itself; settings that change the rounding
# (e.g. FLAGS_B="--kv-cache-dtype fp8") may differ from each other at near ties.
distinct() { md5sum "$@" 2> /dev/null | awk '{print $1}' | sort -u | wc -l; }
within=yes
for v in $(seq "$n"); do
  [ "$(distinct /tmp/ab_text_"${v}"_*.txt)" = 1 ] && [ -s "/tmp/ab_text_${v}_1.txt" ] || within=no
done
if [ "$within" = yes ] && [ "$(distinct /tmp/ab_text_*.txt)" = 1 ]; then
  echo "greedy text: the same from every server start"
elif [ "$within" = yes ]; then
  echo "greedy text: each setting the same in both of its starts; the settings differ"
else
  echo "greedy text DIFFERS between the starts of one setting:"; head -c 300 /tmp/ab_text_*.txt
fi
