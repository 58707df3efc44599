#!/usr/bin/env python3
"""Two or more builds of our prefill kernel on chunked-prefill shapes, timed launch by launch in
one process in rotating order (as bench_interleaved.py does): n_q queries that are the last
n_q positions of n_kv keys under the causal mask (the engine's chunk after a prefix). Run on
the GPU machine (torch there):

    python3 bench/gpu/bench_chunks.py --lib A/libburst_attn.so --lib B/libburst_attn.so \\
        [--shapes 8192:65536,8192:131072,2048:32768] [--head-dims 128,64] [--kernel sm80] \\
        [--rounds 8]

Prints per shape each build's TFLOP/s (median of rounds; FLOPs = 4 d heads x the visible
(query, key) pairs) and each build over the first (median [min, max] of per-round ratios).
No torch baseline here: SDPA's causal mask on n_q < n_kv is aligned at the top left, not at
the end of the keys.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_interleaved import KERNELS, Lib, interleave, ratio_stats, strides9  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", required=True, help="libburst_attn.so (repeat)")
    ap.add_argument("--shapes", default="8192:65536,8192:131072,2048:32768",
                    help="n_q:n_kv,... (n_q <= n_kv)")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--kernel", default="sm80", choices=sorted(KERNELS))
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    libs = [Lib(p) for p in a.lib]
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}; kernel {a.kernel}; {a.rounds} rounds, order rotating")
    print(f"{'d':>4} {'n_q':>7} {'n_kv':>7}  " +
          "  ".join(f"{'lib' + str(i):>8}" for i in range(len(libs))) + "  each / lib0")
    for d in (int(x) for x in a.head_dims.split(",")):
        heads = 4096 // d
        for shape in a.shapes.split(","):
            n_q, n_kv = (int(x) for x in shape.split(":"))
            if not 0 < n_q <= n_kv:
                sys.exit(f"bad shape {shape}: want 0 < n_q <= n_kv")
            gen = torch.Generator(device="cuda").manual_seed(n_q + n_kv + d)
            q = torch.randn(n_q, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(n_kv, heads, d, device="cuda", dtype=torch.bfloat16,
                                generator=gen) for _ in range(2))
            o = torch.empty_like(q)
            lse = torch.empty(heads, n_q, device="cuda", dtype=torch.float32)
            st = strides9(heads, heads, d, n_q)
            pairs = n_q * (n_kv - n_q) + n_q * (n_q + 1) // 2
            flops = 4.0 * d * heads * pairs

            def launch(lib):
                lib.check(lib.lib.burst_attention(
                    q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), n_q,
                    n_kv, heads, heads, d, 2, 0, st, KERNELS[a.kernel], stream),
                    f"n_q={n_q} n_kv={n_kv} d={d}")
            outs = []
            for lib in libs:  # warm up; every build must give the same result
                launch(lib)
                outs.append(o.clone())
            for i, out in enumerate(outs[1:], 1):
                if not torch.equal(out, outs[0]):
                    err = (out.float() - outs[0].float()).abs().max().item()
                    print(f"  note: lib{i} differs from lib0 (max {err:.2e})")
            names = [f"lib{j}" for j in range(len(libs))]
            times = interleave({n: (lambda lib=lib: launch(lib)) for n, lib in zip(names, libs)},
                               a.rounds)
            tf = [flops / statistics.median(times[n]) / 1e9 for n in names]
            ratios = ["%.3f [%.3f, %.3f]" % ratio_stats(times[names[0]], times[n])
                      for n in names[1:]]
            print(f"{d:>4} {n_q:>7} {n_kv:>7}  " + "  ".join(f"{x:8.1f}" for x in tf) + "  " +
                  "  ".join(ratios))


if __name__ == "__main__":
    main()
