#!/usr/bin/env bash
# Installs what burst needs and is missing; safe to run again (idempotent).
# Debian packages for the build and the tests; npm for the tokenizer data. `--trainer` also
# installs what scripts/train_tiny_model.py needs (python3-torch, openblas, the KJV text).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
trainer=0
[ "${1:-}" = "--trainer" ] && trainer=1

debs=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
  libsentencepiece-dev sentencepiece libgloo-dev libcpp-httplib-dev
  python3-sentencepiece python3-grpcio python3-protobuf python3-numpy
  grpc-proto  # upstream health.proto (built into burst-server) and reflection.proto (its test)
  python3-matplotlib bible-kjv  # burst-bench: --plot, and the KJV text workload
)
# Node may come from elsewhere (nodesource); Debian's only when there is none.
command -v npm >/dev/null 2>&1 || debs+=(nodejs npm)
[ $trainer -eq 1 ] && debs+=(python3-torch libopenblas0-pthread bible-kjv)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The LLaMA-2 tokenizer, rebuilt from npm data and checked by sha256 (scripts/make_tokenizer.py).
tok="$root/build/third_party/tokenizer.model"
if [ ! -f "$tok" ]; then
  mkdir -p "$root/build/third_party"
  pkg="$root/build/third_party/llama-tokenizer-js"
  if [ ! -f "$pkg/package/llama-tokenizer.js" ]; then
    mkdir -p "$pkg"
    (cd "$pkg" && npm pack --silent llama-tokenizer-js@1.2.2 >/dev/null && tar xzf llama-tokenizer-js-1.2.2.tgz)
  fi
  /usr/bin/python3 "$root/scripts/make_tokenizer.py" "$pkg/package/llama-tokenizer.js" "$tok"
fi
# Every shipped tokenizer.model must be the one we rebuild (Meta's, byte for byte).
for shipped in "$root"/models/*/tokenizer.model; do
  [ -f "$shipped" ] || continue
  cmp -s "$tok" "$shipped" || { echo "setup: $shipped differs from the rebuilt tokenizer" >&2; exit 1; }
done
# promtool, for test_http's `promtool check metrics`: only that binary (48 MB), taken out of
# Debian's prometheus package (a 19 MB download). Installing the package would add 96 MB more and
# install and start a Prometheus server (a daemon on :9090) on the machine.
prom_dir="$root/build/third_party/prometheus"
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$prom_dir/usr/bin/promtool" ]; then
  mkdir -p "$prom_dir"
  fetch_promtool() {
    (cd "$prom_dir" && apt-get download prometheus >/dev/null 2>&1 &&
      dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool && rm -f prometheus_*.deb)
  }
  if ! fetch_promtool; then
    # The package lists may be missing (a fresh container): update them once and retry.
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq || true
    fetch_promtool || echo "setup: could not fetch promtool; test_http skips its check" >&2
  fi
fi
# The official OpenAI Node SDK, for the server's end-to-end test (tests/server/test_openai_node.sh):
# installed here so the tests run offline.
node_dir="$root/build/node"
if [ ! -d "$node_dir/node_modules/openai" ]; then
  mkdir -p "$node_dir"
  (cd "$node_dir" && npm install --silent --no-audit --no-fund --prefix "$node_dir" openai@4.95.0 >/dev/null)
fi
echo "setup: ok"
