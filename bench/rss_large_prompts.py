#!/usr/bin/python3
"""Resident memory of a running burst-server under repeated large prompts (docs/reliability.md,
"Memory"): sends --count completions of --mb MiB of text each (KJV-like words, so tokenizing
does real work; max_tokens 1) over HTTP, --concurrency at a time, and prints the server's VmRSS
(/proc/PID/status) before, after every round and after an idle --settle seconds. The prompts
may be refused (413: longer than the context) after tokenizing: the memory they cost is the
point. Python standard library only.

  bench/rss_large_prompts.py --base-url http://127.0.0.1:8080 --pid PID --count 20 --mb 2
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

WORDS = ("and the LORD said unto Moses in that day of his people which were before "
         "them thou shalt not").split()


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def prompt(mib, salt):
    out, n, i = [], 0, salt
    while n < mib << 20:
        w = WORDS[i % len(WORDS)]
        out.append(w)
        n += len(w) + 1
        i = i * 1103515245 + 12345 & 0x7FFFFFFF
    return " ".join(out)


def send(url, body):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request("POST", "/v1/completions", body=body,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--pid", type=int, required=True, help="burst-server's pid")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--mb", type=float, default=2, help="MiB of text per prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--settle", type=float, default=3)
    a = ap.parse_args()
    bodies = [json.dumps({"prompt": prompt(int(a.mb), i + 1), "max_tokens": 1})
              for i in range(a.concurrency)]
    print(f"before: {rss_mb(a.pid):.0f} MB", flush=True)
    statuses, sent, peak = {}, 0, 0.0
    while sent < a.count:
        batch = min(a.concurrency, a.count - sent)
        codes = [None] * batch

        def one(k):
            codes[k] = send(a.base_url, bodies[k])

        threads = [threading.Thread(target=one, args=(k,)) for k in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sent += batch
        for c in codes:
            statuses[c] = statuses.get(c, 0) + 1
        now = rss_mb(a.pid)
        peak = max(peak, now)
        print(f"after {sent:3d} prompts: {now:.0f} MB", flush=True)
    time.sleep(a.settle)
    print(f"idle after {a.settle:g} s: {rss_mb(a.pid):.0f} MB (peak seen {peak:.0f} MB); "
          f"statuses {statuses}", flush=True)


if __name__ == "__main__":
    main()
