#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test (ctest). GPU tests
# skip with a message when no GPU is present.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "${BURST_BUILD_DIR:-$root/build}"
# Tests run two at a time and fork ranks: idle OpenMP threads must sleep, not spin.
export OMP_WAIT_POLICY=PASSIVE
ctest --output-on-failure -j "${BURST_TEST_JOBS:-2}" "$@"
