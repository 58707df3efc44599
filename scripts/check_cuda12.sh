#!/usr/bin/env bash
# Compiles burst's CUDA code with a CUDA 12 toolkit (default 12.4, the oldest the project
# supports), to check that no CUDA 13-only API slipped in. Not part of CI or scripts/test.sh
# (it takes many minutes on 2 cores); run it by hand after touching kernels/ or engine/cuda.
#
# The toolkit: NVIDIA's CUDA 12.4.1 as Debian packages it (trixie non-free: nvcc 12.4.131,
# cudart 12.4.127, cuBLAS 12.4.5.8, CCCL 2.3.2, NCCL 2.22.3), or 12.5.0 (experimental), taken
# from the mirror apt already uses (no other registry is reachable here), unpacked, never
# installed: the .debs are extracted into a prefix laid out like NVIDIA's own toolkit (bin/,
# nvvm/, include/, lib64/) with its own nvcc.profile, and the build points CMake at it.
#
#   scripts/check_cuda12.sh --download       # fetch the .debs into the cache (once), then build
#   scripts/check_cuda12.sh                  # build from the cached .debs
#   scripts/check_cuda12.sh --cuda 12.5 --download
#   scripts/check_cuda12.sh --targets "burst_cuda_kernels"   # fewer targets
#
# Options: --cuda 12.4|12.5, --download, --cache DIR (BURST_CUDA12_CACHE, default
# /var/cache/burst-cuda12: the .debs and the unpacked toolkits), --build DIR (default
# /tmp/burst-cuda<V>-build), --arch LIST (default 80-real;90a-real, as the image),
# --targets LIST (default: every target with CUDA sources, and the three executables linked),
# --jobs N (BURST_JOBS, default nproc). The compile runs under nice.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

cuda=12.4
download=0
cache=${BURST_CUDA12_CACHE:-/var/cache/burst-cuda12}
build=""
arch="80-real;90a-real"
targets="burst_cuda_kernels burst_engine burst_gpu_tests burst-bench-kernels"
targets+=" burst-generate burst-worker burst-server"
jobs=${BURST_JOBS:-$(nproc)}
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=$2; shift 2 ;;
    --download) download=1; shift ;;
    --cache) cache=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "check_cuda12: unknown argument $1" >&2; usage ;;
  esac
done
# The Debian suite and the exact versions (what was verified; a newer upload is a new check).
case "$cuda" in
  12.4) suite=trixie; tk=12.4.131~12.4.1-2; rt=12.4.127~12.4.1-2; blas=12.4.5.8~12.4.1-2
        cccl=2.3.2-2; nccl=2.22.3-1-1 ;;
  12.5) suite=experimental; tk=12.5.40~12.5.0-2+b1; rt=12.5.39~12.5.0-2+b1; blas=12.5.2.13~12.5.0-2+b1
        cccl=2.3.2-2; nccl=2.22.3-1-1 ;;
  *) echo "check_cuda12: --cuda 12.4 or 12.5" >&2; exit 2 ;;
esac
build=${build:-/tmp/burst-cuda$cuda-build}
debs=$cache/debs-$cuda
prefix=$cache/cuda-$cuda
t0=$SECONDS

# ---------------------------------------------------------------------------------------------
# 1. The .debs (--download): apt-get download with a private configuration (lists, cache and
#    state under the cache directory), so the machine's apt sources and dpkg database are
#    untouched. The suite's other packages (libc, gcc) are not taken: only files are used.
pkgs=("nvidia-cuda-toolkit=$tk" "nvidia-cuda-dev=$rt" "libcudart12=$rt" "libnvtoolsext1=$rt"
      "libnvvm4=$tk" "libcublas12=$blas" "libcublaslt12=$blas"
      "libcub-dev=$cccl" "libthrust-dev=$cccl" "libcu++-dev=$cccl"
      "libnccl2=$nccl" "libnccl-dev=$nccl")
if [ "$download" -eq 1 ]; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  else
    mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list)
  fi
  apt=$cache/apt-$suite
  mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/sources" "$debs"
  : >"$apt/status"
  # experimental holds only what changed there: trixie beside it for the rest (CCCL, NCCL).
  suites=$suite
  [ "$suite" = experimental ] && suites="trixie experimental"
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main contrib non-free\nSigned-By: %s\n' \
    "$mirror" "$suites" /usr/share/keyrings/debian-archive-keyring.gpg >"$apt/sources/cuda.sources"
  cat >"$apt/apt.conf" <<EOF
Dir::State "$apt";
Dir::State::Lists "$apt/lists";
Dir::State::status "$apt/status";
Dir::Cache "$apt";
Dir::Cache::archives "$apt/archives";
Dir::Etc::SourceList "/dev/null";
Dir::Etc::SourceParts "$apt/sources";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Sandbox::User "root";
EOF
  echo "check_cuda12: downloading CUDA $cuda (Debian $suite) into $debs"
  APT_CONFIG=$apt/apt.conf apt-get update -qq
  (cd "$debs" && APT_CONFIG=$apt/apt.conf apt-get download -qq "${pkgs[@]}")
fi
for p in "${pkgs[@]}"; do
  name=${p%%=*}
  ver=${p#*=}
  ver=${ver//:/%3a}
  ls "$debs/${name}_${ver}_"*.deb >/dev/null 2>&1 ||
    { echo "check_cuda12: $debs has no $name $ver: run with --download" >&2; exit 1; }
done

# ---------------------------------------------------------------------------------------------
# 2. The toolkit prefix, laid out as NVIDIA's (what CMake's CUDA support and FindCUDAToolkit
#    expect), from Debian's split (/usr/bin, /usr/lib/nvidia-cuda-toolkit, /usr/include,
#    /usr/lib/x86_64-linux-gnu). Static libraries other than cudart's are left out (GBs).
stamp=$prefix/.burst-assembled
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${pkgs[*]}" ]; then
  echo "check_cuda12: unpacking into $prefix"
  rm -rf "$prefix" "$prefix.root"
  mkdir -p "$prefix.root"
  for p in "${pkgs[@]}"; do
    name=${p%%=*}
    ver=${p#*=}
    ver=${ver//:/%3a}
    dpkg-deb --fsys-tarfile "$debs/${name}_${ver}_"*.deb |
      tar -x -C "$prefix.root" --exclude='*_static.a' --exclude='*_static_nocallback.a' \
        --exclude='./usr/share/*' --exclude='*/compute-sanitizer/*' --exclude='*/cuda-gdb/*'
  done
  dpkg-deb --fsys-tarfile "$debs/nvidia-cuda-dev_${rt//:/%3a}_"*.deb |
    tar -x -C "$prefix.root" ./usr/lib/x86_64-linux-gnu/libcudart_static.a
  r=$prefix.root
  mkdir -p "$prefix/bin" "$prefix/nvvm/bin"
  mv "$r/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$r/usr/lib/nvidia-cuda-toolkit/bin/crt" "$prefix/bin/"
  mv "$r/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$prefix/nvvm/bin/"
  mv "$r/usr/lib/nvidia-cuda-toolkit/libdevice" "$prefix/nvvm/"
  for t in ptxas fatbinary nvlink cudafe++ bin2c nvprune cuobjdump nvdisasm cu++filt; do
    [ -e "$r/usr/bin/$t" ] && mv "$r/usr/bin/$t" "$prefix/bin/"
  done
  mv "$r/usr/include" "$prefix/include"
  mv "$r/usr/lib/x86_64-linux-gnu" "$prefix/lib64"
  ln -s lib64 "$prefix/lib"
  # Debian's nvcc.profile names /usr paths; this one is NVIDIA's, relative to nvcc itself.
  cat >"$prefix/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
  rm -rf "$r"
  echo "${pkgs[*]}" >"$stamp"
fi
"$prefix/bin/nvcc" --version | tail -2

# ---------------------------------------------------------------------------------------------
# 3. Configure and build (the CUDA targets; nvcc is the toolkit's, the host compiler the
#    system's g++: CUDA 12.4 takes GCC <= 13). Debian trixie builds NCCL from source against
#    its glibc 2.41 (libnccl.so wants __isoc23_strtol@GLIBC_2.38 & co.), which Debian 12's
#    glibc 2.36 lacks: the executables link with --allow-shlib-undefined, which still fails on
#    any symbol burst itself references and the CUDA 12 libraries lack (nothing runs here).
echo "check_cuda12: configuring $build (CUDA $cuda, architectures $arch)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBURST_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$prefix/bin/nvcc" -DCUDAToolkit_ROOT="$prefix" \
  -DBURST_CUDA_ARCHITECTURES="$arch" -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
  >"$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; echo "check_cuda12: configure failed" >&2; exit 1; }
grep -E 'burst: CUDA|Found CUDAToolkit' "$build.configure.log" || true
grep -q "CUDAToolkit_VERSION:.*=$cuda" "$build/CMakeCache.txt" 2>/dev/null ||
  grep -q "CMAKE_CUDA_COMPILER_VERSION.*$cuda" "$build/CMakeFiles/"*/CMakeCUDACompiler.cmake ||
  { echo "check_cuda12: the build did not pick up CUDA $cuda" >&2; exit 1; }
# shellcheck disable=SC2086 # the targets are words
nice -n 15 cmake --build "$build" -j "$jobs" --target $targets 2>&1 | tee "$build.build.log"
# ptxas's notes that it made wgmma wait: C7517 (a warpgroup.wait injected) and C7518 (every
# wgmma serialised). CUDA 12.5.0 does both to the sm90 attention kernel, depending on its
# version; 12.4.1 and 13.0 do neither. Performance, not correctness: no error. Printed only when
# a file compiles, so a rebuild from scratch (rm -rf the build directory) shows them again.
if grep -q -E 'C751[78]' "$build.build.log"; then
  waits=$(grep -c C7517 "$build.build.log" || true)
  serial=$(grep -c C7518 "$build.build.log" || true)
  echo "check_cuda12: WARNING: CUDA $cuda's ptxas: $waits injected warpgroup.wait (C7517)," \
    "$serial serialised wgmma (C7518)" >&2
fi
# Every CUDA source of the tree was compiled for every architecture asked for.
n=0
while IFS= read -r f; do
  o=$(find "$build/CMakeFiles" -path "*/${f}.o" | head -n 1)
  [ -n "$o" ] || { echo "check_cuda12: $f was not compiled (not among --targets?)" >&2; exit 1; }
  n=$((n + 1))
done < <(cd "$root" && git ls-files '*.cu')
echo "check_cuda12: CUDA $cuda: $n .cu files compiled for $arch; built $targets ($((SECONDS - t0)) s)"
