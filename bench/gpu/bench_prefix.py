"""Prefix caching through burst-server's HTTP API, measured by the client (issue 40's numbers).

    python3 bench/gpu/bench_prefix.py PORTS_JSON [--doc 131072] [--questions 20]
                                        [--concurrency 8] [--turns 10] [--turn-tokens 6400]
                                        [--json OUT.json]

Waits for the server's port file and /health. Then, with token-id prompts (exact lengths):
1. a warm-up request, then a DOC-token document (one request, its TTFT);
2. QUESTIONS questions of 50-200 tokens after the document, one after the other: TTFT p50/p99
   and usage.prompt_tokens_details.cached_tokens;
3. the same questions (other ids) CONCURRENCY at once;
4. a chat of TURNS turns, each TURN_TOKENS new tokens after the whole history: TTFT per turn.
Run it against a server with prefix caching and one with --no-prefix-caching: same requests.
"""
import argparse
import json
import statistics
import sys
import threading

from gpu_client import splitmix64, stream_completion, wait_ready

def ids(n, salt):
    return [259 + splitmix64(salt * 1000003 + i) % 31741 for i in range(n)]


def ttft(port, prompt, max_tokens=4):
    """(client TTFT in s, cached prompt tokens) of one streamed greedy request."""
    try:
        first, _, final = stream_completion(port, prompt, max_tokens)
    except RuntimeError as e:
        sys.exit(f"bench_prefix: {e}")
    usage = final.get("usage") or {}
    return first, usage.get("prompt_tokens_details", {}).get("cached_tokens")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(name, runs):
    t = [r[0] for r in runs]
    out = {"name": name, "n": len(t), "p50_ms": 1000 * statistics.median(t),
           "p99_ms": 1000 * pct(t, 99), "max_ms": 1000 * max(t),
           "cached_tokens": [r[1] for r in runs]}
    print(f"{name}: n {out['n']}, TTFT p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
          f"cached {sorted(set(out['cached_tokens']))}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ports")
    ap.add_argument("--doc", type=int, default=131072)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=6400)
    ap.add_argument("--json")
    a = ap.parse_args()
    port = wait_ready(a.ports)
    res = {}
    ttft(port, [1] + ids(64, 1))  # warm-up
    doc = [1] + ids(a.doc - 1, 2)
    t, c = ttft(port, doc)
    res["doc"] = {"tokens": a.doc, "ttft_ms": 1000 * t, "cached_tokens": c}
    print(f"document {a.doc} tokens: TTFT {1000 * t:.1f} ms, cached {c}", flush=True)
    qlen = lambda k: 50 + (k * 37) % 151  # 50..200 tokens
    res["serial"] = summary("questions one at a time",
                            [ttft(port, doc + ids(qlen(k), 100 + k)) for k in range(a.questions)])
    runs = [None] * a.questions
    sem = threading.Semaphore(a.concurrency)

    def one(k):
        with sem:
            runs[k] = ttft(port, doc + ids(qlen(k), 200 + k))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(a.questions)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    res["concurrent"] = summary(f"questions {a.concurrency} at once", runs)
    history, turns = [1], []
    for k in range(a.turns):
        history = history + ids(a.turn_tokens, 300 + k)
        t, c = ttft(port, history)
        turns.append({"turn": k + 1, "prompt_tokens": len(history), "ttft_ms": 1000 * t,
                      "cached_tokens": c})
        print(f"chat turn {k + 1}: {len(history)} tokens, TTFT {1000 * t:.1f} ms, cached {c}",
              flush=True)
    res["chat"] = turns
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
