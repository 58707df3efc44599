# burst: the serving image, in two stages. `build` installs the build dependencies (their own
# layer, before any source is copied, so a source change never re-runs apt), compiles, and lays
# burst out with `cmake --install` into /opt/burst; the runtime stage holds /opt/burst (bin/,
# share/burst/configs, share/burst/models/kjv-tiny, share/burst/bench), the shared libraries the
# binaries link (found by ldd in the build stage, installed by package name), tini, curl and
# python3 (burst-bench). It runs as the
# non-root user `burst`; burst-server is the entrypoint under tini, so SIGTERM reaches it and it
# drains; HEALTHCHECK asks GET /health.
#
# GPU (production; the defaults): a CUDA devel image to build, the matching runtime image to run.
#   docker build -t burst:cuda .
#   (sm_80 + sm_90a; --build-arg BURST_CUDA_ARCHITECTURES=80-real builds for A100 only)
# CPU (CI, laptops): the same file on Debian 12.
#   docker build -t burst:cpu --build-arg BASE_IMAGE=debian:bookworm-slim \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim --build-arg BURST_CUDA=OFF .
# Bases: Debian 12 (tested here) and Ubuntu 24.04 (the CUDA images below; same package names).
# The CUDA form is built and checked here with Debian 12 stand-ins for NVIDIA's images
# (scripts/check_cuda_image.sh; no registry is reachable); docs/deploy.md, "CUDA versions".
# Ubuntu 22.04 images (all CUDA 12.4 images) do not work: cmake 3.22 < 3.25 and gRPC 1.30
# without a CMake package. Driver: CUDA 12.6 needs NVIDIA driver >= 560 (or a datacenter
# driver 535/550 with the forward-compatibility package); docs/deploy.md has the table.
ARG BASE_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04
ARG RUNTIME_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build-deps
ARG DEBIAN_FRONTEND=noninteractive
# scripts/setup.sh's packages that the build needs (its test clients, Node and npm stay out:
# the image runs no test; scripts/test_deploy.sh checks this list against setup.sh's).
# grpc-proto (upstream health.proto, compiled into burst-server) is Debian 12's; where the
# distribution has none (Ubuntu 24.04), the same definitions are written in its place.
RUN set -eu; \
    pkgs="build-essential cmake ninja-build pkg-config ca-certificates \
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
          libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev \
          libsentencepiece-dev libgloo-dev libcpp-httplib-dev"; \
    apt-get update; \
    if apt-cache show grpc-proto >/dev/null 2>&1; then pkgs="$pkgs grpc-proto"; fi; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    v=$(cmake --version | awk 'NR==1{print $3}'); \
    if [ "$(printf '%s\n3.25\n' "$v" | sort -V | head -n1)" != 3.25 ]; then \
      echo "burst needs cmake >= 3.25; this base image has $v (Ubuntu 22.04?): use Debian 12 or Ubuntu 24.04" >&2; \
      exit 1; \
    fi; \
    h=/usr/share/grpc-proto/grpc/health/v1/health.proto; \
    if [ ! -f "$h" ]; then \
      mkdir -p "$(dirname "$h")"; \
      printf '%s\n' 'syntax = "proto3";' 'package grpc.health.v1;' \
        'message HealthCheckRequest { string service = 1; }' \
        'message HealthCheckResponse {' \
        '  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }' \
        '  ServingStatus status = 1;' '}' \
        'service Health {' \
        '  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);' \
        '  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);' '}' > "$h"; \
    fi

FROM build-deps AS build
WORKDIR /src
# Everything .dockerignore lets through (sources, configs, the tiny model): new source
# directories need no change here.
COPY . /src
# BURST_CUDA=OFF: CPU only. BURST_CUDA_ARCHITECTURES: empty = the CMakeLists default
# (80-real;90a-real, which needs CUDA >= 12.0). BUILD_JOBS: parallel compile jobs.
ARG BURST_CUDA=ON
ARG BURST_CUDA_ARCHITECTURES=
ARG BUILD_JOBS=2
# Only what is installed is built (no tests, no benchmarks). The binaries find their data from
# their own location (bin/../share/burst), never from this source tree (BURST_DATA_FROM_SOURCE).
# The runtime stage's packages: the owners of every library the binaries and the tokenizer
# module link, less the C library's (always there).
RUN set -eu; \
    arch_flag=""; \
    if [ -n "$BURST_CUDA_ARCHITECTURES" ]; then arch_flag="-DBURST_CUDA_ARCHITECTURES=$BURST_CUDA_ARCHITECTURES"; fi; \
    cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBURST_CUDA="$BURST_CUDA" \
          $arch_flag -DBURST_DATA_FROM_SOURCE=OFF -DCMAKE_INSTALL_PREFIX=/opt/burst; \
    cmake --build /build -j "$BUILD_JOBS" --target burst-server burst-worker burst-generate burst_spm \
          burst-bench; \
    cmake --install /build --strip; \
    rm -rf /build; \
    for f in /opt/burst/bin/*; do ldd "$f"; done \
      | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
      | while read -r lib; do \
          dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null \
            || echo "runtime libraries: no package owns $lib" >&2; \
        done \
      | cut -d: -f1 | grep -v -x -e libc6 -e libgcc-s1 | sort -u > /opt/burst/share/burst/runtime-packages.txt; \
    cat /opt/burst/share/burst/runtime-packages.txt; \
    /opt/burst/bin/burst-server --check-config > /dev/null

FROM ${RUNTIME_IMAGE} AS runtime-base
COPY --from=build /opt/burst/share/burst/runtime-packages.txt /tmp/runtime-packages.txt
# Packages the runtime image already has (the CUDA libraries of a CUDA runtime image, some of
# them held at their version) are left alone. (No ENV or ARG before this: with --cache-from,
# a first step equal to the build stage's would tie this stage's cache to the wrong image.)
RUN set -eu; \
    missing=""; \
    for p in $(cat /tmp/runtime-packages.txt); do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; \
    done; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tini curl python3 \
        $missing; \
    rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt; \
    useradd --system --user-group --uid 10001 --home-dir /var/lib/burst --create-home \
            --shell /usr/sbin/nologin burst

FROM runtime-base
COPY --from=build /opt/burst /opt/burst
COPY compose/burst-node-workers.sh /opt/burst/bin/burst-node-workers
# BURST_DATA_DIR: explicit, though bin/../share/burst finds the same. OMP_WAIT_POLICY: idle
# OpenMP threads sleep (CPU workers share the container's cores). BURST_HTTP_PORT: where the
# health check asks; set it when the server listens elsewhere.
ENV PATH=/opt/burst/bin:$PATH \
    BURST_DATA_DIR=/opt/burst/share/burst \
    OMP_WAIT_POLICY=PASSIVE \
    BURST_HTTP_PORT=8080
USER burst
WORKDIR /var/lib/burst
# 8080 HTTP (OpenAI API, /health, /metrics), 50051 gRPC, 50052 worker registry (multi-node).
EXPOSE 8080 50051 50052
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD curl -fsS -o /dev/null "http://127.0.0.1:${BURST_HTTP_PORT}/health" || exit 1
# tini -s: also right under `docker run --init` / compose `init: true` (then not PID 1).
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "/opt/burst/bin/burst-server"]
CMD ["--host", "0.0.0.0"]
