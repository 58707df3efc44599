#!/usr/bin/env bash
# The main job on the embedded default: set up, build, then let the tiny KJV model (on CPU)
# continue a prompt, streaming the text and printing prefill time and decode speed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
prompt=${1:-"And God said"}
echo
echo "== burst-generate on models/kjv-tiny (CPU), greedy =="
"$root/build/bin/burst-generate" --model "$root/models/kjv-tiny" --prompt "$prompt" \
  --max-tokens 60 --temperature 0
echo
echo "== the same prompt, sampled (temperature 0.8, top-p 0.95, seed 7) =="
"$root/build/bin/burst-generate" --model "$root/models/kjv-tiny" --prompt "$prompt" \
  --max-tokens 60 --temperature 0.8 --top-p 0.95 --seed 7
