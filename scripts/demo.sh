#!/usr/bin/env bash
# The main job on the embedded default: set up, build, start burst-server with
# configs/cpu-tiny.json (the tiny KJV model on 2 CPU workers), wait for /health, send a
# multi-hundred-token prompt over HTTP (OpenAI SSE) and over gRPC, stream both answers with the
# time to first token, then stop the server (SIGTERM drains it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build=${BURST_BUILD_DIR:-$root/build}
run=$(mktemp -d /tmp/burst-demo-XXXXXX)
export OMP_WAIT_POLICY=PASSIVE
"$build/bin/burst-server" --config "$root/configs/cpu-tiny.json" --http-port 0 --grpc-port 0 \
  --port-file "$run/ports.json" >"$run/server.log" 2>&1 &
server=$!
# Under set -e a failing command in the trap would make the script's status 1 after a good
# run: the server may already be stopped (the end below stops it).
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -rf "$run"' EXIT
for _ in $(seq 600); do [ -f "$run/ports.json" ] && break; sleep 0.1; done
/usr/bin/python3 - "$root" "$run" <<'PY'
import http.client, json, os, subprocess, sys, tempfile, time
root, run = sys.argv[1], sys.argv[2]
ports = json.load(open(os.path.join(run, "ports.json")))
def get(path):
    c = http.client.HTTPConnection("127.0.0.1", ports["http_port"], timeout=10)
    c.request("GET", path); r = c.getresponse(); return r.status, r.read()
for _ in range(1200):
    try:
        if get("/health")[0] == 200: break
    except OSError: pass
    time.sleep(0.1)
print("burst-server healthy: HTTP", ports["http_port"], "gRPC", ports["grpc_port"])
verses = ("In the beginning God created the heaven and the earth. And the earth was without "
          "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
          "moved upon the face of the waters. And God said, Let there be light: and there was "
          "light. And God saw the light, that it was good: and God divided the light from the "
          "darkness. And God called the light Day, and the darkness he called Night. And the "
          "evening and the morning were the first day. ")
prompt = verses * 3 + "And God said,"
c = http.client.HTTPConnection("127.0.0.1", ports["http_port"], timeout=600)
t0 = time.time()
c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 60,
          "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
          {"Content-Type": "application/json"})
r = c.getresponse()
print("\n== HTTP /v1/completions (SSE), greedy ==")
ttft = None
for line in r:
    line = line.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]": continue
    j = json.loads(line[6:])
    if j["choices"] and j["choices"][0]["text"]:
        if ttft is None: ttft = time.time() - t0
        print(j["choices"][0]["text"], end="", flush=True)
    if j.get("usage"):
        u = j["usage"]
print(f"\n[HTTP] prompt {u['prompt_tokens']} tokens, TTFT {ttft * 1000:.0f} ms, "
      f"{u['completion_tokens']} tokens, decode {j['timings']['decode_tokens_per_s']:.1f} tok/s")
out = tempfile.mkdtemp()
subprocess.run(["protoc", f"--proto_path={root}/proto", f"--python_out={out}", f"--grpc_out={out}",
                "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", "burst/v1/burst.proto"],
               check=True)
sys.path.insert(0, out)
import grpc
from burst.v1 import burst_pb2, burst_pb2_grpc
stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}"))
print("\n== gRPC burst.v1.Burst/Generate (stream), temperature 0.8, seed 7 ==")
t0 = time.time(); ttft = None
for ev in stub.Generate(burst_pb2.GenerateRequest(text=prompt, max_tokens=60,
                        sampling=burst_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=7))):
    kind = ev.WhichOneof("event")
    if kind == "started": n = ev.started.prompt_tokens
    elif kind == "token":
        if ttft is None: ttft = time.time() - t0
        print(ev.token.text, end="", flush=True)
    elif kind == "finished":
        f = ev.finished
print(f"\n[gRPC] prompt {n} tokens, TTFT {ttft * 1000:.0f} ms (server: {f.ttft_ms:.0f} ms, "
      f"prefill {f.prefill_ms:.0f} ms), {f.completion_tokens} tokens, decode "
      f"{f.decode_tokens_per_s:.1f} tok/s, finish {f.finish_reason}")
PY
echo
echo "== server log =="
kill -TERM $server; wait $server || true
cat "$run/server.log"
