"""TTFT of the first requests after start, and of a long text prompt against its token ids,
through burst-server's HTTP API (issue 40, items 4 and 5).

    python3 bench/gpu/bench_first_request.py PORTS_JSON --ids N [--text FILE] [--runs 2]

Waits for the port file and /health (the server is ready only after its warm-up), then:
- --ids N: N token ids, the same prompt --runs times in a row: the first request against the
  next ones (run the server with --no-prefix-caching, or the next ones hit the cache);
- --text FILE: the file's text as the prompt, and the ids /tokenize gives for it, alternated
  --runs times: the text's client TTFT against the ids' (tokenizing is on the text's path).
"""
import argparse
import http.client
import json
import sys

from gpu_client import stream_completion, wait_ready


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        sys.exit(f"{path}: HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def ttft(port, prompt):
    try:
        return stream_completion(port, prompt, 2)[0]
    except RuntimeError as e:
        sys.exit(str(e))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ports")
    ap.add_argument("--ids", type=int, default=0)
    ap.add_argument("--text")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    port = wait_ready(a.ports)
    if a.ids:
        prompt = [1] + [259 + (i * 2654435761) % 31741 for i in range(1, a.ids)]
        for k in range(a.runs):
            print(f"{a.ids} ids, request {k + 1}: TTFT {1000 * ttft(port, prompt):.1f} ms",
                  flush=True)
    if a.text:
        text = open(a.text).read()
        ids = post(port, "/tokenize", {"prompt": text})["tokens"]
        print(f"text: {len(text)} bytes, {len(ids)} tokens", flush=True)
        for k in range(a.runs):
            t = ttft(port, text)
            i = ttft(port, ids)
            print(f"run {k + 1}: text TTFT {1000 * t:.1f} ms, ids TTFT {1000 * i:.1f} ms, "
                  f"text / ids {t / i:.4f}", flush=True)


if __name__ == "__main__":
    main()
