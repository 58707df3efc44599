#!/usr/bin/env bash
# The deployment test (CI runs it after scripts/test.sh): the Dockerfile, the compose files and
# the configs, exercised with Debian's own Docker engine (docker.io: dockerd 20.10, started here
# with its state in a temporary directory, stopped at the end) and docker-compose 1.29; the
# base image comes from debootstrap against the mirror apt uses (no registry is reachable).
#   1. static: shellcheck (deployment scripts), every compose file and profile validates
#      (docker-compose config -q), every config parses (burst-server --check-config), the
#      Dockerfile installs what scripts/setup.sh installs for building
#   2. the CPU image from the project's Dockerfile (BASE_IMAGE=debian:bookworm-slim,
#      BURST_CUDA=OFF); docker run: healthy, non-root, completion streamed over HTTP and gRPC,
#      configs checked inside the image, --preset without a model directory, SIGTERM stops it
#   3. docker-compose.yml's `cpu` profile: HTTP + gRPC streams, `down` in seconds
#   4. docker-compose.multinode.yml's `cpu` profile: 2 worker containers join the frontend by
#      service name; streams; SIGKILL of a worker container mid-stream: the error event, 503,
#      then the recovery (the container comes back, the group re-forms, requests succeed)
# Needs root; without root or when dockerd cannot start it says why and exits 0 (skipped).
# Cache (reruns): BURST_DEPLOY_CACHE (default /var/cache/burst-deploy) keeps the debootstrapped
# base image and the build stage's dependencies (its apt layer is reused; the sources always
# rebuild), and the logs of the last run (last-run/: dockerd, build).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091  # make_debian_base
source "$root/scripts/lib/debian_base.sh"
cd "$root"
t0=$SECONDS
passed=0
step() { echo "== [test_deploy +$((SECONDS - t0))s] $*"; }
ok() {
  passed=$((passed + 1))
  echo "ok   $*"
}
fail() {
  echo "FAIL $*" >&2
  echo "test_deploy: $passed passed, 1 failed ($((SECONDS - t0)) s)"
  exit 1
}
skip() {
  echo "test_deploy: SKIPPED: $*"
  exit 0
}

[ -n "${BURST_SKIP_DEPLOY_TEST:-}" ] && skip "BURST_SKIP_DEPLOY_TEST is set"
[ "$(id -u)" -eq 0 ] || skip "not root (apt, debootstrap and dockerd need root)"

cache=${BURST_DEPLOY_CACHE:-/var/cache/burst-deploy}
W=$(mktemp -d /tmp/burst-deploy.XXXXXX)
DOCKERD_PID=""
had_docker0=0
ip link show docker0 >/dev/null 2>&1 && had_docker0=1
cleanup() {
  set +e
  local tc=$SECONDS
  if [ -n "$DOCKERD_PID" ]; then
    "$DOCKER" ps -aq | xargs -r "$DOCKER" rm -f >/dev/null 2>&1
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
    echo "test_deploy: dockerd stopped after $((SECONDS - tc)) s"
  fi
  [ "$had_docker0" -eq 0 ] && ip link delete docker0 >/dev/null 2>&1
  # The logs of the last run stay for a look after a failure.
  rm -rf "$cache/last-run" && mkdir -p "$cache/last-run" && cp "$W"/*.log "$cache/last-run/" 2>/dev/null
  # The engine's state is a few GB of small files (a minute to delete on a busy machine): it is
  # moved aside and deleted in the background, detached from this script.
  if mv "$W" "$W.deleting" 2>/dev/null; then
    setsid nice -n 19 rm -rf "$W.deleting" </dev/null >/dev/null 2>&1 &
  else
    rm -rf "$W"
  fi
  echo "test_deploy: cleaned up in $((SECONDS - tc)) s"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Debian's client and compose, whatever else is on PATH (another docker CLI may be there).
DOCKER=/usr/bin/docker
COMPOSE=/usr/bin/docker-compose
IMAGE=localhost/burst:ci-cpu
DEPS_IMAGE=localhost/burst-build-deps:ci-cpu
export DEBIAN_FRONTEND=noninteractive

step "packages"
APT=(apt-get -o DPkg::Lock::Timeout=600)
need=(docker.io docker-compose debootstrap shellcheck curl python3 python3-grpcio
      python3-protobuf protobuf-compiler protobuf-compiler-grpc iproute2)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}"
  "${APT[@]}" update -qq
  "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---------------------------------------------------------------------------------------------
step "static checks"
shellcheck scripts/test_deploy.sh compose/*.sh .ci/run || fail "shellcheck"
ok "shellcheck: scripts/test_deploy.sh compose/*.sh .ci/run"
compose_checks=(
  "-f docker-compose.yml"
  "-f docker-compose.yml --profile cpu"
  "-f docker-compose.multinode.yml --profile node0"
  "-f docker-compose.multinode.yml --profile workers"
  "-f docker-compose.multinode.yml --profile cpu"
  "-f docker-compose.multinode.yml -f compose/infiniband.yml --profile workers"
)
for args in "${compose_checks[@]}"; do
  # shellcheck disable=SC2086 # the arguments are words
  BURST_SERVER=10.0.0.1 "$COMPOSE" $args config -q || fail "docker-compose $args config"
done
ok "docker-compose config -q: ${#compose_checks[@]} file/profile combinations"
# Every config the compose files name (BURST_CONFIG defaults and literal names) exists and
# parses with the host build's burst-server (scripts/test.sh built it), and so does every
# config shipped.
# shellcheck disable=SC2016 # a literal ${BURST_CONFIG:- is taken off
named=$(grep -ho 'configs/[^ "]*json' docker-compose*.yml | sed -e 's#^configs/##' -e 's/^\${BURST_CONFIG:-//' |
        sort -u)
server_bin=${BURST_BUILD_DIR:-$root/build}/bin/burst-server
for c in $named; do [ -f "configs/$c" ] || fail "a compose file names configs/$c, which does not exist"; done
if [ -x "$server_bin" ]; then
  for c in configs/*.json; do
    "$server_bin" --config "$c" --check-config >"$W/check.out" 2>&1 || { cat "$W/check.out"; fail "$c"; }
  done
  ok "burst-server --check-config: $(echo configs/*.json | wc -w) configs (compose names: $(echo "$named" | tr '\n' ' '))"
fi
# The Dockerfile's build packages: scripts/setup.sh's libraries (-dev) and build tools; the
# rest of its list (Python, Node, test clients) is for the tests, which the image does not run.
setup_pkgs=$(sed -n '/^debs=(/,/^)/p' scripts/setup.sh | sed 's/#.*//' | tr -s ' ()' '\n' |
             grep -E -- '-dev$|^(build-essential|cmake|ninja-build|pkg-config|protobuf-compiler.*|grpc-proto)$' || true)
[ -n "$setup_pkgs" ] || fail "could not read scripts/setup.sh's package list"
for p in $setup_pkgs; do
  grep -qwF -- "$p" Dockerfile || fail "scripts/setup.sh installs $p, the Dockerfile's build stage does not"
done
ok "the Dockerfile's build stage installs scripts/setup.sh's build packages"

# ---------------------------------------------------------------------------------------------
step "dockerd (state in $W)"
# nice: the image's compile runs under this dockerd and shares 2 cores with everything else.
nice -n 10 dockerd --data-root "$W/data" --exec-root "$W/exec" --pidfile "$W/dockerd.pid" \
  -H "unix://$W/docker.sock" >"$W/dockerd.log" 2>&1 &
DOCKERD_PID=$!
export DOCKER_HOST="unix://$W/docker.sock" DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
if ! "$DOCKER" info >/dev/null 2>&1; then
  tail -5 "$W/dockerd.log"
  skip "dockerd did not start here (an unprivileged container?); see its log above"
fi

step "base image debian:bookworm-slim (debootstrap, cached in $cache)"
mkdir -p "$cache"
base_tar=$cache/debian-bookworm-base.tar
# Refreshed monthly: security updates reach the image through its own apt-get upgrade otherwise.
if [ -f "$base_tar" ] && [ -z "$(find "$base_tar" -mtime +30)" ] && "$DOCKER" load -q -i "$base_tar" >/dev/null 2>&1; then
  echo "loaded $base_tar"
else
  make_debian_base "$W" || fail "debootstrap"
  "$DOCKER" save -o "$base_tar.tmp" localhost/debian:bookworm && mv "$base_tar.tmp" "$base_tar"
fi
"$DOCKER" tag localhost/debian:bookworm debian:bookworm-slim
ok "base image"

# ---------------------------------------------------------------------------------------------
step "docker build: the CPU image from ./Dockerfile (log: build.log)"
# The cache: the build stage's dependencies (the build-deps target, with its apt layer), saved
# again only when it changed. (The runtime stage's apt layer is not kept: an intermediate image
# of the classic builder cannot be tagged reliably, and it takes seconds.)
images_tar=$cache/burst-build-deps.tar
cache_from=()
loaded_id=""
if [ -f "$images_tar" ] && "$DOCKER" load -q -i "$images_tar" >/dev/null 2>&1; then
  cache_from=(--cache-from "$DEPS_IMAGE")
  loaded_id=$("$DOCKER" image inspect -f '{{.Id}}' "$DEPS_IMAGE")
  echo "loaded the build dependencies' image from $images_tar"
fi
build_args=(--build-arg BASE_IMAGE=debian:bookworm-slim --build-arg RUNTIME_IMAGE=debian:bookworm-slim
            --build-arg BURST_CUDA=OFF --build-arg BUILD_JOBS=2)
tb=$SECONDS
{ "$DOCKER" build "${build_args[@]}" "${cache_from[@]}" --target build-deps -t "$DEPS_IMAGE" . &&
  "$DOCKER" build "${build_args[@]}" --cache-from "$DEPS_IMAGE" -t "$IMAGE" . ; } >"$W/build.log" 2>&1 ||
  { tail -40 "$W/build.log"; fail "docker build"; }
echo "built in $((SECONDS - tb)) s; $(grep -c 'Using cache' "$W/build.log") cached steps"
if [ "$("$DOCKER" image inspect -f '{{.Id}}' "$DEPS_IMAGE")" != "$loaded_id" ]; then
  ts=$SECONDS
  "$DOCKER" save -o "$images_tar.tmp" "$DEPS_IMAGE" && mv "$images_tar.tmp" "$images_tar"
  echo "saved the build dependencies' image to $images_tar in $((SECONDS - ts)) s"
fi
ok "docker build ($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"

# ---------------------------------------------------------------------------------------------
# The client: HTTP (stdlib) and gRPC (Debian's python3-grpcio; stubs from our proto by protoc).
mkdir -p "$W/pb"
protoc --proto_path=proto --python_out="$W/pb" --grpc_out="$W/pb" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin burst/v1/burst.proto
cat >"$W/client.py" <<'EOF'
"""Deployment test client. health URL SECONDS | http URL | grpc HOST:PORT |
kill URL CONTAINER (SIGKILL a container mid-stream: error event, 503, recovery)."""
import http.client, json, os, subprocess, sys, time, urllib.parse

PROMPT = "And God said"


def request(url, method, path, body=None, timeout=30):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read(), c


def wait_health(url, seconds):
    deadline = time.time() + seconds
    last = ""
    while time.time() < deadline:
        try:
            st, data, _ = request(url, "GET", "/health", timeout=5)
            if st == 200:
                return
            last = f"{st} {data[:200]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.2)
    sys.exit(f"not healthy after {seconds} s: {last}")


def stream(url, max_tokens):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"stream: HTTP {r.status} {r.read()[:300]!r}")
    return c, r


def events(r):
    while True:
        line = r.readline()
        if not line:
            return
        line = line.decode().strip()
        if line.startswith("data:"):
            yield line[5:].strip()


def http_text(url):
    c, r = stream(url, 16)
    text, done, n = "", False, 0
    for d in events(r):
        if d == "[DONE]":
            done = True
            break
        ch = json.loads(d)
        if "error" in ch:
            sys.exit(f"error event {ch}")
        text += ch["choices"][0]["text"]
        n += 1
    c.close()
    if not done or n < 2 or not text.strip():
        sys.exit(f"bad stream: done={done} chunks={n} text={text!r}")
    return text


def grpc_text(target):
    import grpc
    sys.path.insert(0, os.environ["PB_DIR"])
    from burst.v1 import burst_pb2, burst_pb2_grpc
    stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(target))
    req = burst_pb2.GenerateRequest(text=PROMPT, max_tokens=16,
                                    sampling=burst_pb2.SamplingParams(temperature=0))
    evs = list(stub.Generate(req, timeout=60))
    kinds = [e.WhichOneof("event") for e in evs]
    if kinds[0] != "started" or kinds[-1] != "finished" or "token" not in kinds:
        sys.exit(f"gRPC events {kinds}")
    return "".join(e.token.text for e in evs if e.WhichOneof("event") == "token")


def kill(url, container):
    c, r = stream(url, 1500)
    ev = events(r)
    for _ in range(3):
        next(ev)
    t0 = time.time()
    subprocess.run([os.environ.get("DOCKER", "docker"), "kill", "-s", "KILL", container],
                   check=True, stdout=subprocess.DEVNULL)
    error = None
    for d in ev:
        if d == "[DONE]":
            break
        ch = json.loads(d)
        if "error" in ch:
            error = ch["error"]
    took = time.time() - t0
    c.close()
    if error is None or error.get("type") != "service_unavailable":
        sys.exit(f"no service_unavailable error event after the kill: {error}")
    st, data, _ = request(url, "GET", "/health")
    st2, data2, _ = request(url, "POST", "/v1/completions",
                            {"prompt": PROMPT, "max_tokens": 2})
    if st != 503 or st2 != 503:
        sys.exit(f"expected 503 from /health and a request, got {st} {data!r} / {st2} {data2!r}")
    print(f"stream failed {took:.2f} s after the SIGKILL: {error['message'][:100]!r}; "
          f"/health 503 {json.loads(data).get('message', '')!r}; a request 503")


cmd = sys.argv[1]
if cmd == "health":
    wait_health(sys.argv[2], float(sys.argv[3]))
elif cmd == "http":
    print(http_text(sys.argv[2]))
elif cmd == "grpc":
    print(grpc_text(sys.argv[2]))
elif cmd == "kill":
    kill(sys.argv[2], sys.argv[3])
EOF
client() { PB_DIR="$W/pb" DOCKER="$DOCKER" /usr/bin/python3 "$W/client.py" "$@"; }
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HTTP_PORT=$(free_port)
GRPC_PORT=$(free_port)
URL=http://127.0.0.1:$HTTP_PORT
# Docker's own verdict from the image's / the compose file's health check.
wait_docker_healthy() {
  local status=""
  for _ in $(seq 90); do
    status=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null || true)
    [ "$status" = healthy ] && return 0
    sleep 1
  done
  fail "container $1: health status '$status' after 90 s"
}
# The greedy answer must be the same everywhere (same model, greedy, any number of ranks).
reference=""
same_text() {
  if [ -z "$reference" ]; then reference=$1; fi
  [ "$1" = "$reference" ] || fail "$2: '$1' differs from '$reference'"
}

# ---------------------------------------------------------------------------------------------
step "docker run"
user=$("$DOCKER" run --rm --entrypoint id "$IMAGE" -un 2>&1) || true
[ "$user" = burst ] || fail "the image does not run as user burst: $user"
for c in configs/*.json; do
  "$DOCKER" run --rm "$IMAGE" --config "/opt/burst/share/burst/$c" --check-config >"$W/check.out" 2>&1 ||
    { cat "$W/check.out"; fail "$c in the image"; }
done
"$DOCKER" run --rm "$IMAGE" --preset 7b --random-weights 0 --check-config >"$W/check.out" 2>&1 ||
  { cat "$W/check.out"; fail "--preset without a model directory"; }
grep -q '"tokenizer": "/opt/burst/share/burst/models/kjv-tiny/tokenizer.model"' "$W/check.out" ||
  fail "--preset: not the shipped tokenizer: $(cat "$W/check.out")"
if "$DOCKER" run --rm --entrypoint sh "$IMAGE" -c 'ls -d /src /build' >/dev/null 2>&1; then
  fail "the runtime image holds the source or build tree"
fi
ok "image: user burst, every config checks inside it, --preset uses the shipped tokenizer, no source or build tree"
cid=$("$DOCKER" run -d -p "127.0.0.1:$HTTP_PORT:8080" -p "127.0.0.1:$GRPC_PORT:50051" "$IMAGE" \
  --host 0.0.0.0 --threads-per-worker 1)
client health "$URL" 60 || { "$DOCKER" logs "$cid" | tail -20; fail "docker run: /health"; }
text=$(client http "$URL") || fail "docker run: HTTP stream"
same_text "$text" "docker run HTTP"
gtext=$(client grpc "127.0.0.1:$GRPC_PORT") || fail "docker run: gRPC stream"
same_text "$gtext" "docker run gRPC"
wait_docker_healthy "$cid"
ts=$SECONDS
"$DOCKER" stop -t 30 "$cid" >/dev/null
stop_s=$((SECONDS - ts))
[ "$stop_s" -le 10 ] || fail "docker stop took $stop_s s (SIGTERM should drain and exit at once)"
code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$cid")
[ "$code" -eq 0 ] || fail "burst-server exited with $code on SIGTERM"
# The engine copies a container's output asynchronously: its last lines may come a moment late.
# (Into a file first: grep -q ending the pipe early would make `docker logs` fail, pipefail.)
for _ in $(seq 20); do
  "$DOCKER" logs "$cid" >"$W/run.log" 2>&1
  grep -q "signal 15: draining" "$W/run.log" && break
  sleep 0.25
done
grep -q "signal 15: draining" "$W/run.log" || { tail -5 "$W/run.log"; fail "no drain on SIGTERM"; }
"$DOCKER" rm "$cid" >/dev/null
ok "docker run: healthy, streamed '$text' over HTTP and gRPC, SIGTERM drained and exited 0 in ${stop_s} s"

# ---------------------------------------------------------------------------------------------
export BURST_CPU_IMAGE=$IMAGE BURST_HTTP_PORT=$HTTP_PORT BURST_GRPC_PORT=$GRPC_PORT BURST_BIND=127.0.0.1
step "compose, one node (docker-compose.yml, profile cpu)"
C1=("$COMPOSE" -p burstci1 -f docker-compose.yml --profile cpu)
"${C1[@]}" up -d --no-build burst-cpu >"$W/compose1.log" 2>&1 || { cat "$W/compose1.log"; fail "compose up"; }
client health "$URL" 60 || { "${C1[@]}" logs --tail 20; fail "compose: /health"; }
text=$(client http "$URL") || fail "compose: HTTP stream"
same_text "$text" "compose HTTP"
gtext=$(client grpc "127.0.0.1:$GRPC_PORT") || fail "compose: gRPC stream"
same_text "$gtext" "compose gRPC"
wait_docker_healthy "$("${C1[@]}" ps -q burst-cpu)"
ts=$SECONDS
"${C1[@]}" down -t 30 >/dev/null 2>&1
down_s=$((SECONDS - ts))
[ "$down_s" -le 15 ] || fail "compose down took $down_s s"
ok "compose one node: healthy, HTTP + gRPC streams, down in ${down_s} s"

# ---------------------------------------------------------------------------------------------
step "compose, multi-node (docker-compose.multinode.yml, profile cpu)"
C2=("$COMPOSE" -p burstci2 -f docker-compose.multinode.yml --profile cpu)
# The cluster token the compose file passes to the frontend and the workers (docs/deploy.md's
# one-liner; the frontend refuses to start a remote-worker group without one).
BURST_CLUSTER_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export BURST_CLUSTER_TOKEN
"${C2[@]}" up -d --no-build >"$W/compose2.log" 2>&1 || { cat "$W/compose2.log"; fail "compose up"; }
client health "$URL" 90 || { "${C2[@]}" logs --tail 30; fail "multi-node: /health (workers never joined?)"; }
workers=$("${C2[@]}" ps -q worker-cpu | wc -l)
[ "$workers" -eq 2 ] || fail "multi-node: $workers worker containers"
text=$(client http "$URL") || fail "multi-node: HTTP stream"
same_text "$text" "multi-node HTTP"
gtext=$(client grpc "127.0.0.1:$GRPC_PORT") || fail "multi-node: gRPC stream"
same_text "$gtext" "multi-node gRPC"
wait_docker_healthy "$("${C2[@]}" ps -q frontend-cpu)"
ok "compose multi-node: 2 worker containers joined frontend-cpu by service name; HTTP + gRPC streams"

victim=$("${C2[@]}" ps -q worker-cpu | sed -n 1p)
kill_out=$(client kill "$URL" "$victim") || { "${C2[@]}" logs --tail 30; fail "multi-node: SIGKILL of a worker container"; }
echo "$kill_out"
# Recovery: the restart policy brings the container back when Docker does so after a SIGKILL;
# otherwise it is started again here, as an operator (or an orchestrator) would.
sleep 3
if [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$victim")" != true ]; then
  echo "the killed container stays stopped (docker kill counts as a manual stop): starting it"
  "$DOCKER" start "$victim" >/dev/null
fi
tr=$SECONDS
client health "$URL" 90 || { "${C2[@]}" logs --tail 30; fail "multi-node: no recovery"; }
text=$(client http "$URL") || fail "multi-node: HTTP stream after the recovery"
same_text "$text" "multi-node HTTP after the recovery"
ok "multi-node: SIGKILLed worker container -> error event + 503 ($kill_out); recovered in $((SECONDS - tr)) s"
ts=$SECONDS
"${C2[@]}" down -t 30 >/dev/null 2>&1
down_s=$((SECONDS - ts))
[ "$down_s" -le 20 ] || fail "multi-node compose down took $down_s s"
ok "multi-node: down in ${down_s} s"

echo "test_deploy: $passed passed, 0 failed ($((SECONDS - t0)) s)"
