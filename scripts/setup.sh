#!/usr/bin/env bash
# Installs what burst needs and is missing; safe to run again (idempotent).
# Debian packages for the build, the tests and the tiny-model trainer; npm for the tokenizer data.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

debs=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libsentencepiece-dev sentencepiece libgloo-dev libcpp-httplib-dev
  python3-sentencepiece python3-grpcio python3-protobuf python3-numpy
  nodejs npm
)
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
echo "setup: ok"
