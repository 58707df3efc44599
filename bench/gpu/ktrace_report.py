#!/usr/bin/env python3
"""ktrace_report.py FILE.tsv [...]: where a decode step's GPU time goes, from the timeline
libburst_ktrace.so wrote (bench/ktrace.cpp: CUDA_INJECTION64_PATH=.../libburst_ktrace.so).

Per file (one process; files without kernels, e.g. the server's, are skipped): the steps are cut
at each embedding kernel (a forward's first launch); the steps kept are those between
--min-ms and --max-ms long (decode steps, not prefill chunks), the last --last of them. Prints
the median step, the GPU's busy time in it (union of kernel, memcpy and memset intervals) and
its idle time, then per kernel (name without template arguments): launches and microseconds a
step, and the step's largest idle gaps with the records on either side."""
import argparse
import collections
import re
import statistics


def short(name):
    n = re.sub(r"\(.*", "", name.replace("(anonymous namespace)", "anon"))
    depth, out = 0, []
    for ch in n:  # drop template arguments, nested
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    n = "".join(out).strip()
    n = re.sub(r"^(void|.* )(?=[\w:]+$)", "", n)
    return n.split("::")[-1] or name[:40]


def load(path):
    recs = []
    with open(path) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) < 7 or p[0] not in "KCS":
                continue
            recs.append((int(p[1]), int(p[2]), p[0], int(p[4]), p[6]))
    recs.sort()
    return recs


def busy_ns(recs, lo, hi):
    total, cur_s, cur_e = 0, None, None
    for s, e, *_ in recs:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def gaps(recs, lo, hi):
    out, end, prev = [], lo, None
    for r in recs:
        s, e = r[0], r[1]
        if s > end and prev is not None:
            out.append((s - end, prev, r))
        if e > end:
            end, prev = e, r
    if hi > end and prev is not None:
        out.append((hi - end, prev, None))
    return out


def report(path, a):
    recs = load(path)
    kernels = [r for r in recs if r[2] == "K"]
    if not kernels:
        return
    starts = [r[0] for r in kernels if "embedding" in r[4]]
    steps = []
    for lo, hi in zip(starts, starts[1:]):
        ms = (hi - lo) / 1e6
        if a.min_ms <= ms <= a.max_ms:
            steps.append((lo, hi))
    steps = steps[-a.last:]
    print(f"== {path}: {len(kernels)} kernels, {len(starts)} forwards, {len(steps)} steps kept")
    if not steps:
        return
    per_name = collections.defaultdict(lambda: [0, 0.0])
    durs, idles = [], []
    for lo, hi in steps:
        inside = [r for r in recs if lo <= r[0] < hi]
        durs.append((hi - lo) / 1e3)
        idles.append((hi - lo - busy_ns(inside, lo, hi)) / 1e3)
        for s, e, kind, _, name in inside:
            key = short(name) if kind == "K" else name.split(",")[0]
            per_name[key][0] += 1
            per_name[key][1] += (e - s) / 1e3
    n = len(steps)
    med = statistics.median(durs)
    print(f"step: median {med:.1f} us (min {min(durs):.1f}, max {max(durs):.1f}); "
          f"GPU idle in it: median {statistics.median(idles):.1f} us")
    print(f"{'kernel':44s} {'launches':>9s} {'us/step':>9s} {'% step':>7s}")
    for name, (cnt, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:44]:44s} {cnt / n:9.1f} {us / n:9.1f} {100 * us / n / med:7.1f}")
    # The median step's largest idle gaps.
    lo, hi = sorted(steps, key=lambda st: st[1] - st[0])[n // 2]
    inside = [r for r in recs if lo <= r[0] < hi]
    g = sorted(gaps(inside, lo, hi), key=lambda x: -x[0])
    print(f"median step's gaps: {len(g)}, {sum(x[0] for x in g) / 1e3:.1f} us in all; largest:")
    for ns, before, after in g[:a.gaps]:
        b = short(before[4]) if before[2] == "K" else before[4]
        nxt = "(step end)" if after is None else (short(after[4]) if after[2] == "K" else after[4])
        print(f"  {ns / 1e3:8.1f} us after {b[:40]} before {nxt[:40]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--min-ms", type=float, default=0.5)
    ap.add_argument("--max-ms", type=float, default=60.0)
    ap.add_argument("--last", type=int, default=40)
    ap.add_argument("--gaps", type=int, default=12)
    a = ap.parse_args()
    for f in a.files:
        report(f, a)


if __name__ == "__main__":
    main()
