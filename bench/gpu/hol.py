#!/usr/bin/env python3
"""hol.py: what continuous batching changes, measured by a client of burst-server's HTTP API
(any OpenAI-compatible /v1/completions that takes token-id prompts). Standard library only (the
GPU machine's python has no extra packages).

  hol.py --port-file PORTS.json hol [--long 131072] [--long-out 32] [--short 100]
         [--short-n 3] [--short-out 16] [--delay 1.0]
      one long request, then after DELAY s SHORT_N short ones, all streaming and greedy; each
      request's TTFT (from its own send), mean inter-token time and end-to-end time.
  hol.py --port-file PORTS.json decode [--prompt 2048] [--out 128] [--conc 16]
      CONC identical-length requests at once; per-request decode rate (tokens after the first
      over the time from the first to the last token) and their sum: the decode throughput.

Prompts are random token ids (a fresh salt per request: no shared prefixes). Prints one JSON
object.
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time


def token_ids(n, rng):
    return [1] + [rng.randrange(259, 31000) for _ in range(n - 1)]


def stream(port, prompt, max_tokens, result):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times, error = [], None
    if r.status != 200:
        error = f"HTTP {r.status}: {r.read()[:200]!r}"
    else:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = str(chunk["error"])
            for ch in chunk.get("choices", []):
                if ch.get("text"):
                    times.append(time.time())
    c.close()
    result.update(sent=t0, times=times, error=error, prompt=len(prompt))


def summary(r):
    t = r["times"]
    out = {"prompt_tokens": r["prompt"], "chunks": len(t), "error": r["error"]}
    if t:
        out["ttft_s"] = round(t[0] - r["sent"], 4)
        out["e2e_s"] = round(t[-1] - r["sent"], 4)
        if len(t) > 1:
            out["mean_itl_ms"] = round(1000 * (t[-1] - t[0]) / (len(t) - 1), 3)
            out["decode_tok_s"] = round((len(t) - 1) / (t[-1] - t[0]), 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("mode", choices=["hol", "decode"])
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--long-out", type=int, default=32)
    ap.add_argument("--short", type=int, default=100)
    ap.add_argument("--short-n", type=int, default=3)
    ap.add_argument("--short-out", type=int, default=16)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--out", type=int, default=128)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    port = json.load(open(a.port_file))["http_port"]
    rng = random.Random(a.seed if a.seed is not None else time.time_ns())
    if a.mode == "hol":
        long_r = {}
        jobs = [threading.Thread(target=stream,
                                 args=(port, token_ids(a.long, rng), a.long_out, long_r))]
        jobs[0].start()
        shorts = [{} for _ in range(a.short_n)]
        time.sleep(a.delay)
        for s in shorts:
            t = threading.Thread(target=stream, args=(port, token_ids(a.short, rng),
                                                      a.short_out, s))
            t.start()
            jobs.append(t)
        for t in jobs:
            t.join()
        res = {"mode": "hol", "delay_s": a.delay, "long": summary(long_r),
               "short": [summary(s) for s in shorts]}
        if shorts and all(s["times"] for s in shorts) and long_r["times"]:
            res["shorts_first_before_long_first"] = all(
                s["times"][0] < long_r["times"][0] for s in shorts)
    else:
        rs = [{} for _ in range(a.conc)]
        jobs = [threading.Thread(target=stream, args=(port, token_ids(a.prompt, rng), a.out, r))
                for r in rs]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join()
        per = [summary(r) for r in rs]
        res = {"mode": "decode", "conc": a.conc, "prompt": a.prompt, "out": a.out,
               "total_decode_tok_s": round(sum(p.get("decode_tok_s", 0) for p in per), 2),
               "mean_itl_ms": round(sum(p.get("mean_itl_ms", 0) for p in per) / len(per), 3),
               "errors": [p["error"] for p in per if p["error"]], "requests": per}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
