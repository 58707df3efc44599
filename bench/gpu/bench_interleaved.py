#!/usr/bin/env python3
"""Our attention kernels and torch SDPA's (FlashAttention-2 = FLASH_ATTENTION, cuDNN =
CUDNN_ATTENTION) timed launch by launch in ONE process, in rotating order, so every backend runs
under the same clocks. Run on the GPU machine (torch there), with libburst_attn.so from a CUDA
build (bench/attn_capi.cu; bench/gpu/pack.sh carries it):

    python3 bench/gpu/bench_interleaved.py --lib .devpack/bin/libburst_attn.so \\
        [--sizes 4096,16384,65536] [--head-dims 128,64] [--masks full,causal] [--rounds 20] \\
        [--kernels auto,r128,r192,sm80] [--decode-sizes 32768,131072] [--decode-kv-heads 8,32] \\
        [--lib-b OTHER/libburst_attn.so] [--o-f32] [--mma-peak] [--out OUT/interleaved.json]

Why: burst-bench-kernels then bench/gpu/bench_kernels.py time ours and the baselines seconds
apart, and an H100 at its 700 W power cap moved a 16K row 10-20 % between two such timings
(docs/benchmarks.md). Here round r times each backend once, the order rotating by r, and the
ratio ours / cuDNN is taken within each round; the table gives its median and range.

Prefill: bf16, q = kv = S, 4096 / head_dim heads, TFLOP/s = 4 S^2 d heads (halved for
causal); torch gets [1, heads, S, d] tensors, ours the same values packed [S, heads, d] (the
engine's layout). Decode: one query token, 32 q heads x 128, K/V [S, kv heads, 128]; GB/s
counts the K and V bytes; a 2 GiB device copy (torch) runs in the same rotation (GB/s = read +
written). Each timed launch is queued behind a ~1 ms GPU sleep, so the host's launch cost
(Python, ctypes, torch's cuDNN graph cache) never shows as GPU time; each backend's host time
per call is printed, and one that comes near the sleep is flagged. Before timing, each prefill
shape up to 4096 keys is checked against fp32 math (ours' max error at most 2x
FlashAttention-2's + 1e-3) and each decode shape against fp32 math (at most 2x cuDNN's error
+ 1e-4); a failed check exits non-zero. --mma-peak: the tensor-core ceiling of mma.sync (what
the sm_80 kernel and FlashAttention-2 are built from; bench/attn_capi.cu), alone at several
occupancies and in every prefill shape's rotation, so each kernel's FLOP rate is also given as
a fraction of it under the same clocks.
"""
import argparse
import ctypes
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# fp8: FP8 attention (kernels/attention_cuda.h: attention_fp8_cuda, quantization included);
# fp8nh: the same without the Hadamard rotation of q and k; fp8pp: with ping-pong turns;
# fp8r128 / fp8r192: with 128- / 192-row tiles (two or three consumer warpgroups; 192 at head_dim
# 64 only).
KERNELS = {"auto": 0, "sm80": 1, "r128": 2, "r192": 3, "fp8": 4, "fp8nh": 5, "fp8pp": 6,
           "fp8r128": 7, "fp8r192": 8}
SLEEP_CYCLES = 2_000_000  # ~1 ms at Hopper clocks: the queue stays ahead of the host


class Lib:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        p, i, i64p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)
        self.lib.burst_attention.argtypes = [p, p, p, p, p] + [i] * 7 + [i64p, i, p]
        self.lib.burst_attention_decode.argtypes = ([p, p, p, p, p] + [i] * 6 +
                                                    [i64p, p, ctypes.c_size_t, p])
        self.lib.burst_attention_decode_workspace.argtypes = [i] * 6 + [i64p]
        self.lib.burst_attention_decode_workspace.restype = ctypes.c_size_t
        self.lib.burst_attn_last_error.restype = ctypes.c_char_p
        self.lib.burst_mma_peak.argtypes = [i, i, i, ctypes.c_double,
                                            ctypes.POINTER(ctypes.c_double), p]

    def mma_peak(self, ldsm, ctas_per_sm, warps, flops):
        """A launch of the mma.sync ceiling kernel (bench/attn_capi.cu) sized to about `flops`
        FLOPs; returns (run, its exact FLOPs, which the first launch, made here, reports)."""
        out = ctypes.c_double()
        stream = torch.cuda.current_stream().cuda_stream

        def run():
            self.check(self.lib.burst_mma_peak(ldsm, ctas_per_sm, warps, float(flops),
                                               ctypes.byref(out), stream), "mma peak")
        run()
        return run, out.value

    def check(self, err, what):
        if err != 0:
            raise RuntimeError(f"{what}: {self.lib.burst_attn_last_error().decode()} ({err})")


def strides9(heads, kv_heads, d, n_q):
    """Packed [n, heads, d] q/o and [n, kv_heads, d] k/v; lse [heads, n_q]."""
    return (ctypes.c_int64 * 9)(heads * d, d, kv_heads * d, d, kv_heads * d, d, heads * d, d,
                                n_q)


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])


def interleave(fns, rounds):
    """fns: name -> callable. Returns name -> list of ms, one per round, order rotating."""
    names = list(fns)
    host_us = {}
    for n in names:  # warm-up: module load, workspace, autotuning, clocks
        for _ in range(3):
            fns[n]()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fns[n]()  # host time of a warm call: the sleep must cover it
        host_us[n] = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
    near = max(host_us.values()) >= 500
    print("  host us per call: " + ", ".join(f"{n} {u:.0f}" for n, u in host_us.items()) +
          ("  (NEAR THE SLEEP: GPU times may hold host time)" if near else ""))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            fns[n]()
            stop.record()
            stop.synchronize()
            times[n].append(start.elapsed_time(stop))
    return times


def ratio_stats(num, den):
    """Median, min, max of num[r] / den[r] over rounds."""
    q = [a / b for a, b in zip(num, den)]
    return statistics.median(q), min(q), max(q)


class PrefillCase:
    """One prefill shape: bf16 q, k, v of S tokens x 4096 / d heads (torch's [1, heads, S, d]
    and the same values packed [S, heads, d], the engine's layout, for ours), ours' O (fp32
    with o_f32, as the ring's steps write it, else bf16) and LSE, and its FLOPs."""

    def __init__(self, s, d, causal, o_f32=False, gen=None):
        self.s, self.d, self.causal, self.o_f32 = s, d, causal, o_f32
        self.heads = heads = 4096 // d
        self.q, self.k, self.v = (torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16,
                                              generator=gen) for _ in range(3))
        self.qp, self.kp, self.vp = (t.transpose(1, 2).contiguous()
                                     for t in (self.q, self.k, self.v))
        self.o = torch.empty_like(self.qp, dtype=torch.float32 if o_f32 else self.qp.dtype)
        self.lse = torch.empty(heads, s, device="cuda", dtype=torch.float32)
        self.st = strides9(heads, heads, d, s)
        self.flops = 4.0 * s * s * d * heads / (2 if causal else 1)
        self.what = f"S={s} d={d} {'causal' if causal else 'full'}"

    def ours(self, lib, kernel, label):
        """A launch of lib's kernel (a KERNELS key) on this case, on torch's current stream."""
        stream = torch.cuda.current_stream().cuda_stream

        def run():
            lib.check(lib.lib.burst_attention(
                self.qp.data_ptr(), self.kp.data_ptr(), self.vp.data_ptr(), self.o.data_ptr(),
                self.lse.data_ptr(), self.s, self.s, self.heads, self.heads, self.d,
                int(self.causal), 2 if self.o_f32 else 0, self.st, KERNELS[kernel], stream),
                f"ours {label} {self.what}")
        return run

    def sdpa_fn(self, backend):
        """A launch of torch SDPA's backend on this case."""
        return lambda: sdpa(backend, self.q, self.k, self.v, self.causal)


def prefill(libs, s, d, causal, kernels, rounds, o_f32=False, mma_peak=False):
    """libs: label prefix -> Lib ("" for --lib, "B:" for --lib-b); kernels: labels such as
    "auto" or "B:auto"; o_f32: ours write O in fp32 (as the ring's steps do), torch bf16;
    mma_peak: the mma.sync ceiling (operands in registers, 2 CTAs x 4 warps an SM, the sm_80
    kernel's occupancy) joins the rotation, sized to this shape's FLOPs."""
    c = PrefillCase(s, d, causal, o_f32, torch.Generator(device="cuda").manual_seed(s + d + causal))
    q, k, v, o, what = c.q, c.k, c.v, c.o, c.what

    def ours(label):
        prefix, kernel = label.split(":") if ":" in label else ("", label)
        return c.ours(libs[prefix + ":" if prefix else ""], kernel, label)

    if s <= 4096:  # against fp32 math (S^2 scores per head fit)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        flash = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)
        err_flash = (flash.float() - ref).abs().max().item()
        for kernel in kernels:
            ours(kernel)()
            err = (o.transpose(1, 2).float() - ref).abs().max().item()
            if kernel.split(":")[-1].startswith("fp8"):  # coarser by design: tests/gpu bound it
                rmse = (o.transpose(1, 2).float() - ref).pow(2).mean().sqrt().item()
                print(f"  check {what} {kernel}: max error {err:.2e}, RMSE {rmse:.2e} "
                      f"(FA2 {err_flash:.2e})")
                continue
            if not err <= 2 * err_flash + 1e-3:
                sys.exit(f"FAIL {what} {kernel}: max error {err:.3e} against fp32, "
                         f"FlashAttention-2's {err_flash:.3e}")
            print(f"  check {what} {kernel}: max error {err:.2e} (FA2 {err_flash:.2e})")
        del ref, flash
    fns = {f"ours_{kn}": ours(kn) for kn in kernels}
    fns["cudnn"] = c.sdpa_fn(SDPBackend.CUDNN_ATTENTION)
    fns["flash"] = c.sdpa_fn(SDPBackend.FLASH_ATTENTION)
    if mma_peak:
        fns["mma"], mma_flops = libs[""].mma_peak(0, 2, 4, c.flops)
    times = interleave(fns, rounds)
    flops = c.flops
    row = dict(S=s, head_dim=d, heads=c.heads, mask="causal" if causal else "full", rounds=rounds,
               ours_o="fp32" if o_f32 else "bf16")
    for n, t in times.items():
        row[f"{n}_ms"] = statistics.median(t)
        row[f"{n}_tflops"] = (mma_flops if n == "mma" else flops) / (
            statistics.median(t) * 1e-3) / 1e12
    if mma_peak:  # FLOP rate over the ceiling's, paired within each round
        for n in [f"ours_{kn}" for kn in kernels] + ["cudnn", "flash"]:
            row[f"{n}_over_mma"] = [x * flops / mma_flops
                                    for x in ratio_stats(times["mma"], times[n])]
    for kn in kernels:
        for base in ("cudnn", "flash"):
            row[f"ours_{kn}_over_{base}"] = ratio_stats(times[base], times[f"ours_{kn}"])
        if kn.startswith("B:"):  # speed of --lib-b over --lib, paired within each round
            row[f"ours_{kn}_over_a"] = ratio_stats(times[f"ours_{kn[2:]}"], times[f"ours_{kn}"])
    return row


def decode(lib, s, kv_heads, rounds, copy_fn):
    heads, d = 32, 128
    gen = torch.Generator(device="cuda").manual_seed(s + kv_heads)
    q = torch.randn(1, heads, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    qp = q.transpose(1, 2).contiguous()
    kp, vp = (t.transpose(1, 2).contiguous() for t in (k, v))
    o = torch.empty_like(qp)
    lse = torch.empty(heads, 1, device="cuda", dtype=torch.float32)
    st = strides9(heads, kv_heads, d, 1)
    ws_bytes = lib.lib.burst_attention_decode_workspace(1, s, heads, kv_heads, d, 0, st)
    if ws_bytes == 0:
        sys.exit(f"decode S={s}: no workspace size ({lib.lib.burst_attn_last_error().decode()})")
    ws = torch.empty(ws_bytes, device="cuda", dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream

    def ours():
        lib.check(lib.lib.burst_attention_decode(qp.data_ptr(), kp.data_ptr(), vp.data_ptr(),
                                                 o.data_ptr(), lse.data_ptr(), 1, s, heads,
                                                 kv_heads, d, 0, st, ws.data_ptr(), ws_bytes,
                                                 stream), f"ours decode S={s}")

    ours()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                         enable_gqa=kv_heads != heads)
    cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, False)
    err = (o.transpose(1, 2).float() - ref).abs().max().item()
    err_cudnn = (cudnn.float() - ref).abs().max().item()
    if not err <= 2 * err_cudnn + 1e-4:
        sys.exit(f"FAIL decode S={s} kv_heads={kv_heads}: max error {err:.3e} against fp32, "
                 f"cuDNN's {err_cudnn:.3e}")
    print(f"  check decode S={s} kv={kv_heads}: max error {err:.2e} (cuDNN {err_cudnn:.2e})")
    del ref, cudnn
    times = interleave({"ours": ours, "copy": copy_fn,
                        "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, False),
                        "flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, False)},
                       rounds)
    kv_bytes = 2.0 * s * kv_heads * d * 2
    copy_bytes = 2.0 * copy_fn.bytes
    row = dict(S=s, kv_heads=kv_heads, rounds=rounds)
    for n, t in times.items():
        row[f"{n}_ms"] = statistics.median(t)
        row[f"{n}_gbps"] = (copy_bytes if n == "copy" else kv_bytes) / (
            statistics.median(t) * 1e-3) / 1e9
    # Fraction of the copy bandwidth, paired within each round: (bytes / t) / (copy / t_copy).
    row["ours_pct_copy"] = [100 * x * kv_bytes / copy_bytes for x in
                            ratio_stats(times["copy"], times["ours"])]
    row["cudnn_pct_copy"] = [100 * x * kv_bytes / copy_bytes for x in
                             ratio_stats(times["copy"], times["cudnn"])]
    row["cudnn_over_ours"] = ratio_stats(times["cudnn"], times["ours"])
    return row


def ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="libburst_attn.so")
    ap.add_argument("--lib-b", help="a second build's libburst_attn.so, timed in the same "
                    "rotation (A/B of two commits; its rows are labelled B:)")
    ap.add_argument("--sizes", default="4096,16384,65536")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--kernels", default="auto", help="of " + ", ".join(KERNELS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--o-f32", action="store_true",
                    help="ours write O in fp32 (the ring's steps); the baselines bf16")
    ap.add_argument("--mma-peak", action="store_true",
                    help="time the mma.sync ceiling (bench/attn_capi.cu) alone at several "
                    "occupancies, and beside every prefill shape (rows gain x/mma columns)")
    ap.add_argument("--decode-sizes", default="32768,131072")
    ap.add_argument("--decode-kv-heads", default="8,32")
    ap.add_argument("--out")
    args = ap.parse_args()
    lib = Lib(args.lib)
    libs = {"": lib}
    kernels = [k for k in args.kernels.split(",") if k]
    for k in kernels:
        if k not in KERNELS:
            sys.exit(f"unknown kernel {k!r}: one of {', '.join(KERNELS)}")
    if args.lib_b:
        libs["B:"] = Lib(args.lib_b)
        kernels += ["B:" + k for k in kernels]
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{args.rounds} rounds, order rotating"
          + ("; ours write O in fp32" if args.o_f32 else ""))
    peak = []
    if args.mma_peak:
        print("\nmma.sync m16n8k16 bf16 ceiling (fp32 accumulators), TFLOP/s, median of 7 launches")
        for ldsm in (0, 1):
            for cps, warps in ((2, 4), (1, 8), (4, 4), (2, 8), (1, 16)):
                run, fl = lib.mma_peak(ldsm, cps, warps, 2e13)
                t = interleave({"mma": run}, 7)["mma"]
                tf = fl / (statistics.median(t) * 1e-3) / 1e12
                peak.append(dict(ldsm=ldsm, ctas_per_sm=cps, warps=warps, tflops=tf))
                print(f"  B from {'ldmatrix' if ldsm else 'registers':<9} {cps} CTA x {warps:>2} "
                      f"warps an SM: {tf:7.1f}")
    rows = []
    for d in ints(args.head_dims):
        for s in ints(args.sizes):
            for m in args.masks.split(","):
                rows.append(prefill(libs, s, d, m == "causal", kernels, args.rounds, args.o_f32,
                                    args.mma_peak))
                torch.cuda.empty_cache()
    if rows:
        print("\nprefill TFLOP/s (median of rounds); ours / baseline = median [min, max] of "
              "the per-round ratios")
        print(f"{'kernel':<7} {'d':>4} {'S':>6} {'mask':<6} {'ours':>7} {'cudnn':>7} "
              f"{'flash':>7} {'ours/cudnn':>21} {'ours/flash':>8} {'B/A':>21}")
        for r in rows:
            for kn in kernels:
                c = r[f"ours_{kn}_over_cudnn"]
                f = r[f"ours_{kn}_over_flash"]
                b = r.get(f"ours_{kn}_over_a")
                print(f"{kn:<7} {r['head_dim']:>4} {r['S']:>6} {r['mask']:<6} "
                      f"{r[f'ours_{kn}_tflops']:>7.1f} {r['cudnn_tflops']:>7.1f} "
                      f"{r['flash_tflops']:>7.1f} {c[0]:>6.3f} [{c[1]:.3f}, {c[2]:.3f}] "
                      f"{f[0]:>8.2f}" +
                      (f" {b[0]:>6.3f} [{b[1]:.3f}, {b[2]:.3f}]" if b else ""))
        if args.mma_peak:
            print("\nFLOP rate over the mma.sync ceiling's (2 CTAs x 4 warps an SM, same "
                  "rotation): median [min, max] of the per-round ratios")
            for r in rows:
                cells = [f"{n.replace('ours_', '')} {r[n + '_over_mma'][0]:.3f} "
                         f"[{r[n + '_over_mma'][1]:.3f}, {r[n + '_over_mma'][2]:.3f}]"
                         for n in [f"ours_{kn}" for kn in kernels] + ["cudnn", "flash"]]
                print(f"  d={r['head_dim']} S={r['S']} {r['mask']:<6} mma {r['mma_tflops']:.1f}: "
                      + "; ".join(cells))
    drows = []
    if args.decode_sizes:
        a = torch.empty(1 << 30, device="cuda", dtype=torch.int16)  # 2 GiB
        b = torch.empty_like(a)
        a.fill_(1)

        def copy_fn():
            b.copy_(a)
        copy_fn.bytes = a.numel() * a.element_size()
        for s in ints(args.decode_sizes):
            for kvh in ints(args.decode_kv_heads):
                drows.append(decode(lib, s, kvh, args.rounds, copy_fn))  # --lib only
                torch.cuda.empty_cache()
        print("\ndecode, one token, 32 q heads x 128; % of copy = median [min, max] of the "
              "per-round values")
        print(f"{'keys':>7} {'kv':>3} {'ours ms':>8} {'cudnn ms':>8} {'flash ms':>8} "
              f"{'copy GB/s':>9} {'ours % copy':>22} {'cudnn % copy':>22} {'cudnn/ours':>10}")
        for r in drows:
            o, c = r["ours_pct_copy"], r["cudnn_pct_copy"]
            print(f"{r['S']:>7} {r['kv_heads']:>3} {r['ours_ms']:>8.4f} {r['cudnn_ms']:>8.4f} "
                  f"{r['flash_ms']:>8.4f} {r['copy_gbps']:>9.0f} "
                  f"{o[0]:>6.1f} [{o[1]:.1f}, {o[2]:.1f}] {c[0]:>9.1f} [{c[1]:.1f}, {c[2]:.1f}]"
                  f" {r['cudnn_over_ours'][0]:>10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "prefill": rows,
                       "decode": drows, "mma_peak": peak}, f, indent=1)


if __name__ == "__main__":
    main()
