"""TTFT through burst-server's OpenAI-compatible HTTP API, measured by the client.

    python3 scripts/gpu/server_ttft.py PORTS_JSON N [N ...]

Waits for the server's port file and /health, then for each N streams one /v1/completions
request whose prompt is N token ids (BOS, then the ids burst-generate --prompt-tokens uses),
max_tokens 8, greedy, and prints the client-side time to the first streamed token, the total,
and the server's own timings from the usage chunk.
"""
import http.client
import json
import sys
import time

from gpu_client import splitmix64, wait_ready

def main():
    ports_file, sizes = sys.argv[1], [int(x) for x in sys.argv[2:]]
    port = wait_ready(ports_file, timeout=600)
    for n in sizes:
        prompt = [1] + [259 + splitmix64(i) % 31741 for i in range(1, n)]
        body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}})
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
        t0 = time.time()
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            print(f"{n} tokens: HTTP {r.status}: {r.read()[:300]!r}", flush=True)
            continue
        ttft, final = None, {}
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if ttft is None and j.get("choices"):
                ttft = time.time() - t0
            if j.get("usage"):
                final = j
        total = time.time() - t0
        print(f"{n} tokens: client TTFT {ttft:.2f} s, total {total:.2f} s, "
              f"usage {final.get('usage')}, timings {final.get('timings')}", flush=True)


if __name__ == "__main__":
    main()
