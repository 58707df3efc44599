#!/usr/bin/env bash
# ab_decode.sh PACK_A PACK_B [WORKERS]: the same decode workload through burst-server built two
# ways, on one machine in one call, alternating A B A B (so drift hits both): a 2K-context
# sequence decoding 128 tokens alone, 3 runs per server (the first warms up). PACK_* are
# tar.xz files of a .devpack (scripts/gpu/pack.sh BUILD burst-server burst-worker
# libburst_spm.so, then tar -cJf X.tar.xz .devpack), carried in a git-ignored folder.
# From the repository root on the GPU machine; WORKERS (default 2) GPUs, 7B preset.
set -u
[ $# -ge 2 ] || { sed -n '2,7p' "$0" >&2; exit 2; }
workers=${3:-2}
export NCCL_NVLS_ENABLE=0
i=0
for pack in "$1" "$2"; do
  i=$((i + 1))
  mkdir -p "/tmp/ab$i" && python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$pack" "/tmp/ab$i"
done
for v in 1 2 1 2; do
  name=$([ "$v" = 1 ] && echo A || echo B)
  ( source "/tmp/ab$v/.devpack/env.sh"
    pf=/tmp/ab_ports_$v.json; rm -f "$pf"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((workers - 1))) burst-server --preset 7b --random-weights 0 \
      --tokenizer models/kjv-tiny/tokenizer.model --device cuda --workers "$workers" \
      --max-context 140000 --kv-capacity $((180000 * workers)) --http-port 0 --grpc-port -1 \
      --port-file "$pf" > "/tmp/ab_server_$v.log" 2>&1 &
    sp=$!
    for _ in $(seq 300); do
      [ -s "$pf" ] && curl -sf "http://127.0.0.1:$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['http_port'])" "$pf")/health" > /dev/null && break
      sleep 0.3
    done
    for r in 1 2 3; do
      timeout 60 python3 scripts/gpu/hol.py --port-file "$pf" decode --prompt 2048 --out 128 --conc 1 \
        | python3 -c "import json,sys;d=json.load(sys.stdin);print('$name run $r: %.1f tok/s, ITL %.3f ms'%(d['total_decode_tok_s'],d['mean_itl_ms']))"
    done
    kill "$sp"; wait "$sp" )
done
