#!/usr/bin/env python3
"""ktrace_summary.py FILE.tsv [...]: per process, where the GPU time of a whole run went, from
the timeline libburst_ktrace.so wrote (bench/ktrace.cpp). For runs that are not decode steps
(ktrace_report.py cuts those): e.g. burst-bench-ring's ranks,
    CUDA_INJECTION64_PATH=.devpack/bin/libburst_ktrace.so BURST_KTRACE_DIR=/tmp/kt \\
        burst-bench-ring --world 4 --seq 131072 --reps 3
Per file: the span from its first to its last kernel, the GPU's busy time in it (union of
kernel, memcpy and memset intervals) and, per kernel name (template arguments dropped), the
launches, total and mean time, and the share of the span; with --match NAME also the duration
percentiles of the kernels whose name contains NAME."""
import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ktrace_report import busy_ns, load, short  # noqa: E402  (one place for each)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="kernel names to list (default 12)")
    ap.add_argument("--match", default="", help="percentiles of kernels whose name has this")
    a = ap.parse_args()
    for path in a.files:
        recs = load(path)  # (start, end, kind, stream, name), sorted
        kernels = [r for r in recs if r[2] == "K"]
        if not kernels:
            continue
        t0, t1 = min(r[0] for r in kernels), max(r[1] for r in kernels)
        span = t1 - t0
        busy = busy_ns(recs, t0, t1)
        print(f"{os.path.basename(path)}: span {span / 1e6:.2f} ms, GPU busy {busy / 1e6:.2f} ms "
              f"({100 * busy / max(span, 1):.1f} %), {len(kernels)} kernels")
        per = collections.defaultdict(list)
        for r in kernels:
            per[short(r[4])].append(r[1] - r[0])
        for name, ds in sorted(per.items(), key=lambda kv: -sum(kv[1]))[: a.top]:
            tot = sum(ds)
            print(f"  {name[:48]:<48} {len(ds):6d} x {statistics.mean(ds) / 1e3:9.1f} us = "
                  f"{tot / 1e6:9.2f} ms ({100 * tot / max(span, 1):5.1f} % of the span)")
        if a.match:
            ds = sorted(r[1] - r[0] for r in kernels if a.match in r[4])
            if ds:
                q = lambda f: ds[min(len(ds) - 1, int(f * len(ds)))] / 1e3  # noqa: E731
                print(f"  '{a.match}': {len(ds)} launches, us p10 {q(0.1):.1f} p50 {q(0.5):.1f} "
                      f"p90 {q(0.9):.1f} max {ds[-1] / 1e3:.1f}")


if __name__ == "__main__":
    main()
