#!/usr/bin/env bash
# bench_sweep.sh: starts burst-server with a config on free ports, runs a list of burst-bench
# workloads against it (one result JSON per point), then writes a combined markdown table and
# plots, and stops the server.
#   scripts/bench_sweep.sh [--config FILE] [--workloads FILE] [--out DIR] [-- SERVER FLAGS...]
# Defaults: configs/cpu-tiny.json, bench/workloads/cpu-tiny.txt (one point per line: NAME and
# burst-bench flags; see that file), DIR = build/bench-sweep/<date>. Results:
#   DIR/points/NAME.json   burst-bench --result-json of each point (vLLM field names)
#   DIR/table.md           one row per point (burst-bench --report)
#   DIR/plots/*.png        TTFT vs prompt length, TTFT CDF, output tokens/s over time
#   DIR/server.log
# Environment: BURST_BUILD_DIR (default build), COMMON (flags added to every point, default
# "--num-warmups 1 --ignore-eos"), SEED (adds --seed SEED: the same prompts on every run).
# Exit status: 0 when every point ran and completed at least one request.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BURST_BUILD_DIR:-$root/build}
config=configs/cpu-tiny.json
workloads=$root/bench/workloads/cpu-tiny.txt
out=$root/build/bench-sweep/$(date +%Y%m%d-%H%M%S)
server_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; server_args=("$@"); break ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
  esac
done
cd "$root" || exit 1
[ -x "$build/bin/burst-server" ] || { echo "bench_sweep: no $build/bin/burst-server: build first" >&2; exit 1; }
if [ -x "$build/bin/burst-bench" ]; then
  bench=("$build/bin/burst-bench")
else
  bench=(/usr/bin/python3 "$root/bench/burst_bench.py")
fi
mkdir -p "$out/points"
rm -f "$out/ports.json"
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} "$build/bin/burst-server" --config "$config" \
  --http-port 0 --grpc-port 0 --port-file "$out/ports.json" "${server_args[@]}" \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  [ -s "$out/ports.json" ] && break
  kill -0 $server 2>/dev/null || { echo "bench_sweep: burst-server exited:" >&2; tail -20 "$out/server.log" >&2; exit 1; }
  sleep 0.1
done
[ -s "$out/ports.json" ] || { echo "bench_sweep: no port file after 60 s" >&2; exit 1; }
port() { /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$out/ports.json" "$1"; }
http="http://127.0.0.1:$(port http_port)"
grpc="127.0.0.1:$(port grpc_port)"
echo "bench_sweep: burst-server ($config) on $http, gRPC $grpc; results in $out"
read -r -a common <<< "${COMMON:---num-warmups 1 --ignore-eos}"
[ -n "${SEED:-}" ] && common+=(--seed "$SEED")
status=0
points=()
while read -r name rest; do
  [ -z "$name" ] || [[ "$name" == \#* ]] && continue
  rest=${rest//\{http\}/$http}
  rest=${rest//\{grpc\}/$grpc}
  read -r -a flags <<< "$rest"
  target=()
  [[ " $rest " == *" --grpc "* || " $rest " == *" --base-url "* ]] || target=(--base-url "$http")
  echo "== $name: ${flags[*]}"
  "${bench[@]}" "${target[@]}" "${flags[@]}" "${common[@]}" --wait-ready 120 --label "$name" \
    --result-json "$out/points/$name.json" > "$out/points/$name.txt" 2> "$out/points/$name.err" \
    || { status=1; echo "   failed: $(tail -2 "$out/points/$name.err")"; }
  [ -s "$out/points/$name.json" ] && points+=("$out/points/$name.json")
  grep -E "Successful|Failed requests|Mean TTFT|Median TTFT|Output token throughput" \
    "$out/points/$name.txt" | sed 's/^/   /'
done < "$workloads"
if [ ${#points[@]} -gt 0 ]; then
  "${bench[@]}" --report "${points[@]}" --markdown "$out/table.md" --plot "$out/plots" \
    2> "$out/report.err" || status=1
  grep "wrote" "$out/report.err"
else
  status=1
fi
exit $status
