#!/usr/bin/env bash
# The official OpenAI Node SDK (npm `openai`, installed by scripts/setup.sh into build/node)
# streaming from burst-server's /v1/completions and /v1/chat/completions. Skips (exit 77) with a
# message when node or the SDK is absent. Usage: test_openai_node.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
node_dir=${BURST_NODE_DIR:-$root/build/node}
if ! command -v node >/dev/null 2>&1; then echo "SKIP: node is not installed"; exit 77; fi
if [ ! -d "$node_dir/node_modules/openai" ]; then
  echo "SKIP: the openai SDK is not in $node_dir (run scripts/setup.sh)"; exit 77
fi
exec /usr/bin/python3 - "$build" "$node_dir" "$here" <<'PY'
import os, subprocess, sys
sys.path.insert(0, sys.argv[3])
sys.argv = [sys.argv[0], "--build", sys.argv[1], sys.argv[2]]
from harness import HAVE_KJV, PROMPT, Server
node_dir = sys.argv[3]
with Server("--api-key", "node-key") as srv:
    env = dict(os.environ, NODE_PATH=os.path.join(node_dir, "node_modules"),
               BASE_URL=f"http://127.0.0.1:{srv.http_port}/v1", PROMPT=PROMPT,
               MODEL=srv.json("GET", "/v1/models", None,
                              {"Authorization": "Bearer node-key"})[1]["data"][0]["id"],
               CHAT="1" if HAVE_KJV else "0")
    r = subprocess.run(["node", os.path.join(sys.path[0], "openai_client.cjs")], env=env)
    sys.exit(r.returncode)
PY
