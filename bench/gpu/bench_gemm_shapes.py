#!/usr/bin/env python3
"""The 7B prefill's linear layers as cuBLAS runs them (torch.mm, bf16), in the shapes burst
launches and in fused or larger-chunk alternatives, so that a change to the model's GEMM shapes
is measured before it is made.

    python3 bench/gpu/bench_gemm_shapes.py [--rows 131072] [--rounds 5]

Rows: separate q, k and v projections (three [rows, 4096] x [4096, 4096]) against one fused
[4096, 12288]; the MLP's gate and up (two [m, 4096] x [4096, 11008]) against one fused
[4096, 22016], and its down projection [m, 11008] x [11008, 4096], for MLP chunks of m = 4096
(burst's `mlp_chunk_rows`), 8192, 16384 and 32768 rows, each summed over the chunks of `rows`.
A shape's time is the median of `rounds` CUDA-event timings of all its launches back to back,
after one warm-up; TFLOP/s = 2 m n k over that time. Inputs are random (never zero).
"""
import argparse

import torch


def time_ms(fn, rounds):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    rows, hid, ff = args.rows, args.hidden, args.intermediate
    gen = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * 0.02 + 0.01

    x = rand(rows, hid)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, rows {rows}")
    print(f"{'shape':44s} {'ms':>9s} {'TFLOP/s':>8s}")

    def report(name, flops, ms):
        print(f"{name:44s} {ms:9.2f} {flops / ms / 1e9:8.1f}")

    # Weights as checkpoints store them and burst keeps them, [out, in]: y = x W^T.
    # Attention's input projections over all rows.
    w3 = [rand(hid, hid) for _ in range(3)]
    out3 = [torch.empty(rows, hid, device=dev, dtype=dt) for _ in range(3)]
    wqkv = torch.cat(w3, dim=0).contiguous()
    out_qkv = torch.empty(rows, 3 * hid, device=dev, dtype=dt)
    flops = 2.0 * rows * hid * 3 * hid
    report("q, k, v: 3 x [rows,4096]x[4096,4096]", flops,
           time_ms(lambda: [torch.mm(x, w.t(), out=o) for w, o in zip(w3, out3)], args.rounds))
    report("qkv fused: [rows,4096]x[4096,12288]", flops,
           time_ms(lambda: torch.mm(x, wqkv.t(), out=out_qkv), args.rounds))
    del out3, out_qkv, w3, wqkv

    # The MLP, chunk by chunk.
    wg, wu, wd = rand(ff, hid), rand(ff, hid), rand(hid, ff)
    wgu = torch.cat([wg, wu], dim=0).contiguous()
    for m in (4096, 8192, 16384, 32768):
        if rows % m:
            continue
        g = torch.empty(m, ff, device=dev, dtype=dt)
        u = torch.empty(m, ff, device=dev, dtype=dt)
        gu = torch.empty(m, 2 * ff, device=dev, dtype=dt)
        act = rand(m, ff)
        y = torch.empty(m, hid, device=dev, dtype=dt)
        chunks = [x[r:r + m] for r in range(0, rows, m)]
        flops = 2.0 * rows * hid * 2 * ff

        def sep():
            for c in chunks:
                torch.mm(c, wg.t(), out=g)
                torch.mm(c, wu.t(), out=u)

        def fused():
            for c in chunks:
                torch.mm(c, wgu.t(), out=gu)

        def down():
            for _ in chunks:
                torch.mm(act, wd.t(), out=y)

        report(f"gate, up: 2 x [{m},4096]x[4096,{ff}]", flops, time_ms(sep, args.rounds))
        report(f"gate+up fused: [{m},4096]x[4096,{2 * ff}]", flops, time_ms(fused, args.rounds))
        report(f"down: [{m},{ff}]x[{ff},4096]", 2.0 * rows * ff * hid, time_ms(down, args.rounds))
        del g, u, gu, act, y


if __name__ == "__main__":
    main()
