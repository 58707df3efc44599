"""What the GPU machine's client scripts share (server_ttft.py, bench_prefix.py,
bench_first_request.py, hf_prefill.py): the token ids burst-generate --prompt-tokens uses
(splitmix64 of the position), waiting for a burst-server's port file and /health, and one
streamed completion timed by the client."""
import http.client
import json
import os
import sys
import time

MASK64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def wait_ready(ports_file, timeout=900):
    """The HTTP port once the server's port file exists and /health answers 200 (after its
    warm-up); prints how long /health took after the port file."""
    deadline = time.time() + timeout
    while not os.path.exists(ports_file):
        if time.time() > deadline:
            sys.exit(f"{ports_file}: no port file after {timeout} s")
        time.sleep(0.2)
    port = json.load(open(ports_file))["http_port"]
    t0 = time.time()
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                print(f"ready {time.time() - t0:.1f} s after the port file", flush=True)
                return port
        except OSError:
            pass
        if time.time() > deadline:
            sys.exit("the server never became healthy")
        time.sleep(0.2)


def stream_completion(port, prompt, max_tokens):
    """One streamed greedy /v1/completions request (usage included): (client TTFT in s, total
    in s, the last chunk that carried usage, {} if none). RuntimeError on an HTTP error."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first, final = None, {}
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if first is None and j.get("choices"):
            first = time.time() - t0
        if j.get("usage"):
            final = j
    c.close()
    return first, time.time() - t0, final
