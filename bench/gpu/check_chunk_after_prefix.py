#!/usr/bin/env python3
"""check_chunk_after_prefix.py --lib LIB: our kernels on a chunk of prefill after a long prefix
as ONE causal launch (n_q queries, the last n_q positions of n_kv keys), against an fp32
reference by torch on the GPU, at sizes the GPU tests do not reach (their reference is on the
host). Prints the max error and RMSE of each kernel beside bf16 SDPA's (same inputs, the
lower-right causal mask), per (n_q, n_kv). Run on the GPU machine (torch there).

    python3 bench/gpu/check_chunk_after_prefix.py --lib .devpack/bin/libburst_attn.so \\
        [--sizes 8192:16384,8192:65536] [--kernels auto,r128,fp8] [--heads 32]
"""
import argparse
import ctypes
import math

import torch
import torch.nn.functional as F

from bench_interleaved import KERNELS, Lib, strides9


def reference(q, k, v, n_q, n_kv):
    """fp32 attention of q [heads, n_q, d] against k, v [heads, n_kv, d], query i seeing keys
    j <= n_kv - n_q + i, a head at a time."""
    out = torch.empty(q.shape, device="cuda", dtype=torch.float32)
    pos_q = torch.arange(n_q, device="cuda")[:, None] + (n_kv - n_q)
    pos_k = torch.arange(n_kv, device="cuda")[None, :]
    hidden = pos_k > pos_q
    for h in range(q.shape[0]):
        s = (q[h].float() @ k[h].float().T) / math.sqrt(q.shape[-1])
        s.masked_fill_(hidden, float("-inf"))
        out[h] = torch.softmax(s, dim=-1) @ v[h].float()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--sizes", default="8192:16384,8192:65536,8192:131072")
    ap.add_argument("--kernels", default="auto,r128,fp8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    lib = Lib(a.lib)
    gen = torch.Generator(device="cuda").manual_seed(7)
    heads, d = a.heads, a.head_dim
    for size in a.sizes.split(","):
        n_q, n_kv = (int(x) for x in size.split(":"))
        k, v = (torch.randn(heads, n_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        q = torch.randn(heads, n_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = reference(q, k, v, n_q, n_kv)
        mask = (torch.arange(n_kv, device="cuda")[None, :]
                <= torch.arange(n_q, device="cuda")[:, None] + (n_kv - n_q))
        sd = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        err = (sd.float() - ref)
        print(f"n_q {n_q} n_kv {n_kv}: sdpa bf16 max {err.abs().max():.3e} "
              f"rmse {err.pow(2).mean().sqrt():.3e}", flush=True)
        qp, kp, vp = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        st = strides9(heads, heads, d, n_q)
        for name in a.kernels.split(","):
            o = torch.empty_like(qp)
            lse = torch.empty(heads, n_q, device="cuda", dtype=torch.float32)
            lib.check(lib.lib.burst_attention(
                qp.data_ptr(), kp.data_ptr(), vp.data_ptr(), o.data_ptr(), lse.data_ptr(), n_q,
                n_kv, heads, heads, d, 2, 0, st, KERNELS[name],
                torch.cuda.current_stream().cuda_stream), name)
            torch.cuda.synchronize()
            e = o.transpose(0, 1).float() - ref
            print(f"  {name}: max {e.abs().max():.3e} rmse {e.pow(2).mean().sqrt():.3e}",
                  flush=True)


if __name__ == "__main__":
    main()
