#!/usr/bin/env bash
# train_tiny.sh: on the GPU machine, from the repository root, with .devpack carried
# (bench/gpu/pack.sh BUILD_DIR burst_gpu_tests burst-generate libburst_spm.so first) and the
# KJV text in .devpack/kjv.txt (scripts/train_tiny_model.py --dump-corpus .devpack/kjv.txt here,
# where Debian's bible-kjv is). Retrains the embedded default model and checks it; the results
# come back as $OUT/results.tar.aa, .ab, ... (`cat results.tar.* | tar -x`: the device tool
# returns at most 8 files of 16 MiB):
#   1. scripts/train_tiny_model.py --device cuda  -> $OUT/kjv-tiny (copied over models/kjv-tiny)
#   2. scripts/make_golden.py --only kjv-tiny      -> $OUT/golden/kjv-tiny/golden.json (HF)
#   3. the GPU tests (the trained model on the CUDA engine against the CPU engine, every kernel)
#   4. greedy and sampled text from the CUDA engine, for reading
# MINUTES (default 3) and SEED (default 1234) are the training's.
set -uo pipefail
final=${OUT:-$PWD/gpu-out}
out=$PWD/train-out
mkdir -p "$out" "$final"
# shellcheck disable=SC2317  # called by the EXIT trap
pack() { tar -cf - -C "$out" . | split -b 15M - "$final/results.tar."; }
trap pack EXIT
# shellcheck disable=SC1091
source .devpack/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 scripts/train_tiny_model.py --device cuda --corpus .devpack/kjv.txt \
  --tokenizer models/kjv-tiny/tokenizer.model --out "$out/kjv-tiny" \
  --minutes "${MINUTES:-3}" --seed "${SEED:-1234}" 2>&1 | tee "$out/train.log" || exit 1
cp "$out/kjv-tiny/config.json" "$out/kjv-tiny/model.safetensors" \
  "$out/kjv-tiny/training_log.txt" models/kjv-tiny/
rm -f "$out/kjv-tiny/tokenizer.model"  # the tracked one is unchanged
timeout 300 python3 scripts/make_golden.py "$out/golden" --only kjv-tiny 2>&1 \
  | tee "$out/golden.log"
status=0
BURST_SOURCE_DIR=$PWD timeout 300 burst_gpu_tests > "$out/gpu_tests.log" 2>&1 || status=1
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |\[ info" "$out/gpu_tests.log"
grep -E -A7 "Failure$" "$out/gpu_tests.log" | head -60
for p in "And God said" "In the beginning" "The LORD is my shepherd" "Jesus wept" \
         "And it came to pass"; do
  for t in 0 0.8; do
    printf '== %s (temperature %s)\n' "$p" "$t"
    timeout 60 burst-generate --model models/kjv-tiny --device cuda --prompt "$p" \
      --max-tokens 80 --temperature "$t" --seed 7 2>&1
  done
done | tee "$out/samples.txt"
exit $status
