#!/usr/bin/env python3
"""Side-by-side baseline for burst-bench-kernels: times torch SDPA (FLASH_ATTENTION and
CUDNN_ATTENTION backends) at the attention shapes found in our bench's JSON and prints the
ratio table ours / torch. Run on the GPU machine (torch 2.11 there):

    python3 bench/gpu/bench_kernels.py --ours OUT/bench_kernels.json [--out OUT/torch.json]

Same conventions as ours: bf16, [1, heads, S, head_dim] random inputs, is_causal for the causal
rows (q and kv both start at position 0), TFLOP/s = 4 * S^2 * d * heads (halved for causal),
CUDA events, one warm-up call, median of at least 3 calls (up to 20 or ~2 s), each queued behind
a ~1 ms GPU sleep as burst-bench-kernels does.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def median_ms(fn):
    fn()  # warm-up
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while len(times) < 3 or (len(times) < 20 and sum(times) < 2000.0):
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host's launch work stays off the GPU time
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times), len(times)


def time_torch(backend, s_q, s_kv, heads, kv_heads, d, causal, what):
    """Median ms of torch SDPA on `backend` for q [1, heads, s_q, d] against k, v
    [1, kv_heads, s_kv, d] (GQA when kv_heads < heads), and the number of runs; None, 0 where
    the backend refuses the shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, s_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, s_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    with sdpa_kernel(BACKENDS[backend]):
        try:
            return median_ms(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=kv_heads != heads))
        except RuntimeError as e:  # backend unavailable for this shape
            print(f"  {backend} {what}: {str(e).splitlines()[0]}")
            return None, 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="JSON written by burst-bench-kernels --out")
    ap.add_argument("--out", help="write the combined table as JSON here")
    args = ap.parse_args()
    with open(args.ours) as f:
        ours = json.load(f)
    rows = []
    torch_at = {}  # (S, mask, head_dim) -> torch's ms per backend, timed once for every kernel
    for r in ours["results"]:
        if r["op"] not in ("attention", "attention_sm80", "attention_r128", "attention_r192"):
            continue
        s, heads, d, causal = r["S"], r["heads"], r["head_dim"], r["mask"] == "causal"
        flops = 4.0 * s * s * d * heads / (2 if causal else 1)
        key = (s, r["mask"], d)
        if key not in torch_at:
            torch_at[key] = {}
            for backend in BACKENDS:
                ms, _ = time_torch(backend, s, s, heads, heads, d, causal,
                                   f"S={s} d={d} causal={causal}")
                torch_at[key][backend] = ms
                torch.cuda.empty_cache()
        row = dict(S=s, mask=r["mask"], heads=heads, head_dim=d, kernel=r["op"],
                   ours_ms=r["ms"], ours_tflops=r["tflops"])
        for backend, ms in torch_at[key].items():
            row[f"{backend}_ms"] = ms
            row[f"{backend}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
        rows.append(row)

    def fmt(x, spec):
        return format(x, spec) if x is not None else "n/a"

    print(f"\nattention, bf16, 4096 / head_dim heads, on {torch.cuda.get_device_name()} "
          f"(torch {torch.__version__}); kernel attention = what the engine runs here, "
          f"attention_sm80 = the mma.sync kernel (an A100's), attention_r128 / _r192 = ours with "
          f"128- / 192-row query tiles forced (head_dim 64)")
    print(f"{'kernel':<15} {'d':>4} {'S':>7} {'mask':<7} {'ours TF/s':>10} {'flash TF/s':>11} "
          f"{'cudnn TF/s':>11} {'ours/flash':>11} {'ours/cudnn':>11}")
    for r in rows:
        rf = r["ours_tflops"] / r["flash_tflops"] if r["flash_tflops"] else None
        rc = r["ours_tflops"] / r["cudnn_tflops"] if r["cudnn_tflops"] else None
        print(f"{r['kernel']:<15} {r['head_dim']:>4} {r['S']:>7} {r['mask']:<7} "
              f"{r['ours_tflops']:>10.1f} "
              f"{fmt(r['flash_tflops'], '>11.1f')} {fmt(r['cudnn_tflops'], '>11.1f')} "
              f"{fmt(rf, '>11.2f')} {fmt(rc, '>11.2f')}")
    copy = next((r["gbps"] for r in ours["results"] if r["op"] == "copy"), None)
    decode_rows = []
    for r in ours["results"]:
        if r["op"] not in ("decode", "decode_mha"):
            continue
        s, heads, kvh, d = r["S"], r["heads"], r["kv_heads"], r["head_dim"]
        kv_bytes = 2.0 * s * kvh * d * 2
        row = dict(S=s, kv_heads=kvh, ours_ms=r["ms"], ours_gbps=r["gbps"])
        for backend in BACKENDS:
            ms, _ = time_torch(backend, 1, s, heads, kvh, d, False, f"decode S={s}")
            row[f"{backend}_ms"] = ms
            row[f"{backend}_gbps"] = kv_bytes / (ms * 1e-3) / 1e9 if ms else None
            torch.cuda.empty_cache()
        decode_rows.append(row)
    if decode_rows:
        print(f"\ndecode, one token, 32 q heads x 128 (kv heads as listed), bf16; device copy "
              f"{fmt(copy, '.0f')} GB/s (read + write)")
        print(f"{'keys':>7} {'kv':>3} {'ours ms':>8} {'ours GB/s':>10} {'% copy':>7} "
              f"{'flash ms':>9} {'cudnn ms':>9} {'flash/ours':>11} {'cudnn/ours':>11}")
        for r in decode_rows:
            pc = 100.0 * r["ours_gbps"] / copy if copy else None
            rf = r["flash_ms"] / r["ours_ms"] if r["flash_ms"] else None
            rc = r["cudnn_ms"] / r["ours_ms"] if r["cudnn_ms"] else None
            print(f"{r['S']:>7} {r['kv_heads']:>3} {r['ours_ms']:>8.3f} {r['ours_gbps']:>10.0f} "
                  f"{fmt(pc, '>7.1f')} "
                  f"{fmt(r['flash_ms'], '>9.3f')} {fmt(r['cudnn_ms'], '>9.3f')} "
                  f"{fmt(rf, '>11.2f')} {fmt(rc, '>11.2f')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows, "decode": decode_rows, "copy_gbps": copy}, f, indent=1)


if __name__ == "__main__":
    main()
