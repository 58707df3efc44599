#!/usr/bin/env python3
"""Attention launched back to back, as a prefill runs it layer after layer, on the GPU machine:
TFLOP/s with the SM clock and the board power (nvidia-smi every 100 ms) while each backend
runs, ours and torch SDPA's cuDNN in alternating blocks (ours, cuDNN, cuDNN, ours):

    python3 bench/gpu/bench_sustained.py --lib .devpack/bin/libburst_attn.so \\
        [--lib-b OTHER/libburst_attn.so] [--kernel auto|sm80|r128|r192] [--seconds 3] \\
        [--shapes 128:4096:full,128:16384:causal,64:4096:full]

Why: bench/gpu/bench_interleaved.py queues each timed launch behind a ~1 ms GPU sleep, so
every launch starts with power to spare; back to back an H100 sits at its 700 W cap with the
SM clock at 1450-1800 MHz of 1980, 10-13 % fewer TFLOP/s, and a kernel that spends less
energy a FLOP gets more clock (docs/benchmarks.md, 2026-11-27 session 20). Shapes as in
bench_interleaved.py: bf16, q = kv = S, 4096 / head_dim heads, TFLOP/s = 4 S^2 d heads (halved
for causal). With --lib-b the second build runs as a third backend ("B").
"""
import argparse
import subprocess
import sys
import time

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_interleaved as bi  # noqa: E402  (Lib, PrefillCase, KERNELS)


def measure(fn, flops, seconds):
    """(TFLOP/s, median SM clock MHz, median power W) of fn run back to back for `seconds`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    t0, n = time.time(), 0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    e1.record()
    torch.cuda.synchronize()
    smi.terminate()
    # The first samples fall in the warm-up, the last may be cut: both left out.
    rows = [r.split(", ") for r in smi.communicate()[0].strip().splitlines()[3:-1]]
    if not rows:
        sys.exit("nvidia-smi gave no samples: run longer (--seconds)")
    clk = sorted(float(r[0]) for r in rows)
    pw = sorted(float(r[1]) for r in rows)
    ms = e0.elapsed_time(e1) / n
    return flops / ms / 1e9, clk[len(clk) // 2], pw[len(pw) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="libburst_attn.so")
    ap.add_argument("--lib-b", help="a second build's libburst_attn.so")
    ap.add_argument("--kernel", default="auto", choices=sorted(bi.KERNELS))
    ap.add_argument("--seconds", type=float, default=3.0, help="per block")
    ap.add_argument("--shapes", default="128:4096:full,128:4096:causal,128:16384:full,"
                    "128:16384:causal,64:4096:full,64:16384:full,64:16384:causal",
                    help="head_dim:S:mask, comma separated")
    args = ap.parse_args()
    libs = {"ours": bi.Lib(args.lib)}
    if args.lib_b:
        libs["B"] = bi.Lib(args.lib_b)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; {args.seconds} s a block, kernel {args.kernel}")
    for shape in args.shapes.split(","):
        d, s, mask = shape.split(":")
        d, s, causal = int(d), int(s), mask == "causal"
        c = bi.PrefillCase(s, d, causal)
        fns = {name: c.ours(lib, args.kernel, name) for name, lib in libs.items()}
        fns["cudnn"] = c.sdpa_fn(SDPBackend.CUDNN_ATTENTION)
        flops = c.flops
        res = {name: [] for name in fns}
        order = list(fns)
        for rep in range(2):  # forwards, then backwards: each backend once early, once late
            for name in order if rep == 0 else order[::-1]:
                res[name].append(measure(fns[name], flops, args.seconds))
        mean = {name: sum(r[0] for r in rs) / len(rs) for name, rs in res.items()}
        ratios = " ".join(f"{name}/cudnn {mean[name] / mean['cudnn']:.3f}"
                          for name in fns if name != "cudnn")
        blocks = " | ".join(
            f"{name} " + "; ".join(f"{t:.1f} TFLOP/s {c:.0f} MHz {p:.0f} W" for t, c, p in rs)
            for name, rs in res.items())
        print(f"d{d} {s} {mask}: {ratios} | {blocks}", flush=True)


if __name__ == "__main__":
    main()
