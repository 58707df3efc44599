#!/usr/bin/env bash
# burst-node-workers (bash >= 5.1): the burst-worker processes of one node of a multi-node group, in one
# container (so that NCCL sees every local GPU and can use NVLink/P2P between them). Starts
# BURST_WORKERS_PER_NODE workers, each `burst-worker --join $BURST_JOIN --device cuda:<i>` (or
# `--device cpu` with BURST_WORKER_DEVICE=cpu) plus this script's arguments (the model:
# --model DIR or --preset NAME --random-weights SEED; --advertise-host, --threads ...), and
# starts a worker again when it exits (a crash, or a refusal: exit code 4, retried after 10 s;
# a worker whose group broke re-executes itself and is not restarted here). SIGTERM/SIGINT stop
# every worker and the script.
set -u
n=${BURST_WORKERS_PER_NODE:-8}
device=${BURST_WORKER_DEVICE:-cuda}
join=${BURST_JOIN:-}
if [ -z "$join" ] || [ "${join#:}" != "$join" ]; then
  echo "burst-node-workers: no server address (BURST_JOIN='$join'): set BURST_SERVER (compose) or" \
       "BURST_JOIN=HOST:PORT, the address of burst-server --worker-listen" >&2
  exit 2
fi
case "$n" in '' | *[!0-9]*) echo "burst-node-workers: BURST_WORKERS_PER_NODE=$n" >&2; exit 2 ;; esac

declare -A pids=()
stopping=0
stop() {
  stopping=1
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
}
trap stop TERM INT

start() {
  local i=$1 dev=$device
  shift
  [ "$device" = cuda ] && dev="cuda:$i"
  burst-worker --join "$join" --device "$dev" "$@" &
  pids[$i]=$!
  echo "burst-node-workers: worker $i (pid ${pids[$i]}, $dev) joining $join"
}

for ((i = 0; i < n; i++)); do start "$i" "$@"; done
while [ "$stopping" -eq 0 ]; do
  done_pid=""
  wait -n -p done_pid
  rc=$?
  [ "$stopping" -eq 1 ] && break
  [ -n "$done_pid" ] || { sleep 1; continue; }
  for i in "${!pids[@]}"; do
    [ "${pids[$i]}" = "$done_pid" ] || continue
    delay=2
    [ "$rc" -eq 4 ] && delay=10
    echo "burst-node-workers: worker $i exited with code $rc; starting it again in $delay s" >&2
    sleep "$delay"
    [ "$stopping" -eq 1 ] || start "$i" "$@"
  done
done
# A worker that was leaving its group when the signal came (its server stopped first) may have
# taken the signal for its own re-execution and gone on registering: signal again until every
# worker is gone, and SIGKILL what is left after 10 s.
for ((t = 0; t < 20; t++)); do
  alive=()
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
  [ ${#alive[@]} -eq 0 ] && break
  [ "$t" -gt 0 ] && [ $((t % 2)) -eq 0 ] && kill -TERM "${alive[@]}" 2>/dev/null
  sleep 0.5
done
for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
wait
echo "burst-node-workers: stopped"
