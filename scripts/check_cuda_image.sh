#!/usr/bin/env bash
# Builds the CUDA image from the project's Dockerfile where no registry is reachable (no
# nvidia/cuda images): it makes two local stand-ins for NVIDIA's devel and runtime images from
# a CUDA toolkit on this machine (default /usr/local/cuda) on Debian 12, builds the Dockerfile
# with them (--build-arg BASE_IMAGE / RUNTIME_IMAGE; the architectures are the Dockerfile's
# defaults, sm_80 + sm_90a, unless --arch), and checks the runtime image without a GPU:
# `--version` of the three executables, burst-generate on the tiny model with --device cpu, and
# --device cuda failing with a clear message. Prints the image sizes and the build time.
# Not part of CI (about an hour on 2 cores); run it by hand after changing the Dockerfile.
#
#   scripts/check_cuda_image.sh [--cuda-home DIR] [--arch LIST] [--jobs N] [--keep]
#
# Needs root and Debian's docker.io and debootstrap. dockerd runs with its state in a temporary
# directory and without a bridge (the builds use the host's network, the containers none), so
# it does not touch another engine's docker0; it is stopped at the end (--keep: left running
# and its socket printed, to look at the images). The Debian base image comes from
# scripts/test_deploy.sh's cache (BURST_DEPLOY_CACHE, /var/cache/burst-deploy), or debootstrap;
# the logs of the last run are kept in its cuda-image-last-run/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091  # make_debian_base
source "$root/scripts/lib/debian_base.sh"
cd "$root"
cuda_home=/usr/local/cuda
arch=""
jobs=2
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda-home) cuda_home=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[ "$(id -u)" -eq 0 ] || { echo "check_cuda_image: needs root (dockerd)" >&2; exit 1; }
cuda_home=$(readlink -f "$cuda_home")
[ -x "$cuda_home/bin/nvcc" ] || { echo "check_cuda_image: no $cuda_home/bin/nvcc" >&2; exit 1; }
cuda_version=$("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
cache=${BURST_DEPLOY_CACHE:-/var/cache/burst-deploy}
DOCKER=/usr/bin/docker
W=$(mktemp -d /tmp/burst-cuda-image.XXXXXX)
DOCKERD_PID=""
cleanup() {
  set +e
  # The logs of the last run (dockerd, the build) stay for a look.
  rm -rf "$cache/cuda-image-last-run" && mkdir -p "$cache/cuda-image-last-run" &&
    cp "$W"/*.log "$cache/cuda-image-last-run/" 2>/dev/null
  if [ -n "$DOCKERD_PID" ] && [ "$keep" -eq 0 ]; then
    "$DOCKER" ps -aq | xargs -r "$DOCKER" rm -f >/dev/null 2>&1
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
    # dockerd leaves its default network namespace bind-mounted (the rm below would not go).
    umount "$W/exec/netns/default" 2>/dev/null
    mv "$W" "$W.deleting" && { setsid nice -n 19 rm -rf "$W.deleting" </dev/null >/dev/null 2>&1 & }
  elif [ -n "$DOCKERD_PID" ]; then
    echo "check_cuda_image: dockerd (pid $DOCKERD_PID) left running: DOCKER_HOST=unix://$W/docker.sock"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
t0=$SECONDS
say() { echo "== [check_cuda_image +$((SECONDS - t0))s] $*"; }

say "dockerd (state in $W)"
nice -n 10 dockerd --data-root "$W/data" --exec-root "$W/exec" --pidfile "$W/dockerd.pid" \
  -H "unix://$W/docker.sock" --bridge=none --iptables=false --ip6tables=false >"$W/dockerd.log" 2>&1 &
DOCKERD_PID=$!
export DOCKER_HOST="unix://$W/docker.sock" DOCKER_BUILDKIT=0
for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
"$DOCKER" info >/dev/null 2>&1 || { tail -5 "$W/dockerd.log"; echo "dockerd did not start" >&2; exit 1; }

say "Debian 12 base image"
base_tar=$cache/debian-bookworm-base.tar
if ! { [ -f "$base_tar" ] && "$DOCKER" load -q -i "$base_tar" >/dev/null 2>&1; }; then
  make_debian_base "$W" || exit 1
fi

# ---------------------------------------------------------------------------------------------
# The stand-ins. NVIDIA's devel image: the toolkit at /usr/local/cuda-X.Y, /usr/local/cuda
# pointing at it, its libraries known to ld.so, and NVIDIA's environment (PATH, LIBRARY_PATH
# with the driver stub, LD_LIBRARY_PATH for the driver the container toolkit mounts). Only the
# libraries burst uses are copied (cudart, cuBLAS, NCCL, the driver stub), not cuDNN, cuFFT...
# The runtime image: cudart, cuBLAS and NCCL only.
say "CUDA $cuda_version stand-ins from $cuda_home"
ctx=$W/cuda-ctx
mkdir -p "$ctx"
keep_libs='libcudart\..*|libcudart_static\.a|libcudadevrt\.a|libculibos\.a|libcublas(Lt)?\.so.*'
keep_libs+='|libnccl\.so.*|libnvToolsExt\.so.*|libnvtx3interop\.so.*'
(cd "$cuda_home" && tar -c --exclude='./lib*/lib*' --exclude='./targets/*/lib/lib*' --exclude='./dist-info' . |
   tar -x -C "$ctx" --one-top-level=devel)
for d in lib lib64 targets/x86_64-linux/lib; do
  if [ ! -d "$cuda_home/$d" ] || [ -L "$cuda_home/$d" ]; then continue; fi
  (cd "$cuda_home/$d" && find . -maxdepth 1 \( -type f -o -type l \) -printf '%f\n' |
     grep -E "^($keep_libs)$" | tar -c -T - | tar -x -C "$ctx/devel/$d")
done
mkdir -p "$ctx/runtime"
for f in "$ctx"/devel/lib*/lib* "$ctx"/devel/targets/x86_64-linux/lib/lib*; do
  [ -e "$f" ] || continue
  case "$(basename "$f")" in
    libcudart.so*|libcublas.so*|libcublasLt.so*|libnccl.so*) cp -a "$f" "$ctx/runtime/" ;;
  esac
done
cat >"$ctx/Dockerfile.devel" <<EOF
FROM localhost/debian:bookworm
COPY devel /usr/local/cuda-$cuda_version
RUN ln -s cuda-$cuda_version /usr/local/cuda && \\
    echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/000_cuda.conf && ldconfig
ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \\
    LIBRARY_PATH=/usr/local/cuda/lib64/stubs \\
    CUDA_VERSION=$cuda_version NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
EOF
cat >"$ctx/Dockerfile.runtime" <<EOF
FROM localhost/debian:bookworm
COPY runtime /usr/local/cuda-$cuda_version/lib64
RUN ln -s cuda-$cuda_version /usr/local/cuda && \\
    echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/000_cuda.conf && ldconfig
ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \\
    CUDA_VERSION=$cuda_version NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
EOF
devel=localhost/cuda:$cuda_version-devel-debian12
runtime=localhost/cuda:$cuda_version-runtime-debian12
"$DOCKER" build -q -f "$ctx/Dockerfile.devel" -t "$devel" "$ctx" >/dev/null
"$DOCKER" build -q -f "$ctx/Dockerfile.runtime" -t "$runtime" "$ctx" >/dev/null
rm -rf "$ctx"

# ---------------------------------------------------------------------------------------------
image=localhost/burst:cuda$cuda_version-check
args=(--build-arg BASE_IMAGE="$devel" --build-arg RUNTIME_IMAGE="$runtime" --build-arg BUILD_JOBS="$jobs")
[ -n "$arch" ] && args+=(--build-arg BURST_CUDA_ARCHITECTURES="$arch")
say "docker build ${args[*]} (log: $W/build.log)"
tb=$SECONDS
nice -n 15 "$DOCKER" build --network host "${args[@]}" -t "$image" . >"$W/build.log" 2>&1 ||
  { tail -40 "$W/build.log"; echo "check_cuda_image: docker build failed" >&2; exit 1; }
build_s=$((SECONDS - tb))
grep -E 'burst: CUDA|Found CUDAToolkit|generate-code' "$W/build.log" | head -5 || true

say "checks in the runtime image (no GPU here)"
run() { "$DOCKER" run --rm --network none "$@"; }
run "$image" --version
run --entrypoint /opt/burst/bin/burst-worker "$image" --version
run --entrypoint /opt/burst/bin/burst-generate "$image" --version
run --entrypoint sh "$image" -c 'ldd /opt/burst/bin/burst-worker | grep -E "cuda|cublas|nccl"'
out=$(run --entrypoint /opt/burst/bin/burst-generate "$image" --model /opt/burst/share/burst/models/kjv-tiny \
  --prompt "And God said" --max-tokens 12 --temperature 0 --device cpu 2>&1) ||
  { echo "$out"; echo "check_cuda_image: burst-generate --device cpu failed" >&2; exit 1; }
echo "$out"
set +e
out=$(run --entrypoint /opt/burst/bin/burst-generate "$image" --model /opt/burst/share/burst/models/kjv-tiny \
  --prompt "And God said" --max-tokens 4 --device cuda 2>&1)
code=$?
set -e
echo "$out" | tail -3
[ "$code" -ne 0 ] || { echo "check_cuda_image: --device cuda succeeded without a GPU?" >&2; exit 1; }
echo "--device cuda without a GPU: exit $code"
# The image's default command (the tiny model on 2 CPU workers) serves: /health from inside.
cid=$("$DOCKER" run -d --network none "$image")
healthy=0
for _ in $(seq 60); do
  if "$DOCKER" exec "$cid" curl -fsS -o /dev/null http://127.0.0.1:8080/health 2>/dev/null; then
    healthy=1
    break
  fi
  sleep 1
done
"$DOCKER" stop -t 30 "$cid" >/dev/null
stop_code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$cid")
"$DOCKER" logs "$cid" 2>&1 | tail -3
"$DOCKER" rm "$cid" >/dev/null
[ "$healthy" -eq 1 ] || { echo "check_cuda_image: the default command never served /health" >&2; exit 1; }
[ "$stop_code" -eq 0 ] || { echo "check_cuda_image: burst-server exited $stop_code on SIGTERM" >&2; exit 1; }
echo "default command: /health 200, SIGTERM exit 0"
"$DOCKER" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'localhost/(burst|cuda)'
say "CUDA $cuda_version image: built in $build_s s; checks passed"
