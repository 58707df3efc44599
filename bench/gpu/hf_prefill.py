"""HF transformers prefill (TTFT) of the LLaMA-2-7B shape, the baseline of bench_prefill.sh.

    python3 bench/gpu/hf_prefill.py --lengths 4096,16384 --reps 3 --out hf.jsonl
    python3 bench/gpu/hf_prefill.py --report ours.jsonl hf.jsonl [--cli cli.txt]

The first form builds LlamaForCausalLM (7B config, random init, bf16, SDPA attention) on the
GPU and times, per length, one forward over the prompt that burst-generate --prompt-tokens N
builds (BOS, then 259 + splitmix64(i) % 31741), with the KV cache kept (use_cache=True, as a
server's prefill must) and logits for the last position only, then the argmax: the time to the
first token. torch.no_grad, CUDA synchronised around each run, one warm-up, median of --reps.

With --decode-tokens N, each length also times N greedy decode steps after a fresh prefill
(transformers' default DynamicCache, one token per forward, synchronised per step): the
median ms per token, HF's TPOT beside burst-generate's decode rate.

The second form prints the ratio table of our JSON lines (tests/gpu/cuda_backend_test.cpp,
CudaPrefillBench) against HF's, with TFLOP/s from FLOPs = 2 * 6.48e9 * S + 262144 * S^2 (the
7B linear layers, plus causal attention in the FlashAttention convention) against the 770
TFLOP/s bf16 matmul peak of an H100 (DESIGN.md section 6).
"""
import argparse
import json
import statistics
import sys
import time

from gpu_client import splitmix64

PEAK_TFLOPS = 770.0

def prompt(n, vocab=32000):
    return [1] + [259 + splitmix64(i) % (vocab - 259) for i in range(1, n)]


def flops(s):
    return 2 * 6.48e9 * s + 262144.0 * s * s


def bench(lengths, reps, out_path, decode_tokens=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                         max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.eval()
    torch.set_default_dtype(torch.float32)
    print(f"hf: transformers model on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"attn {model.config._attn_implementation}", flush=True)
    out = open(out_path, "w")
    for n in lengths:
        ids = torch.tensor([prompt(n)], dtype=torch.long, device="cuda")
        times, first = [], -1
        for rep in range(reps + 1):  # rep 0 is the warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                first = int(res.logits[0, -1].argmax().item())  # waits for the GPU
            ms = (time.perf_counter() - t0) * 1e3
            del res
            torch.cuda.empty_cache()
            if rep > 0:
                times.append(ms)
        decode_ms = None
        if decode_tokens > 0:
            steps = []
            with torch.no_grad():
                res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
                del res
                for _ in range(decode_tokens):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    res = model(input_ids=tok, past_key_values=past, use_cache=True,
                                logits_to_keep=1)
                    past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
                    tok.item()  # waits for the GPU, as a server's sampling would
                    steps.append((time.perf_counter() - t0) * 1e3)
                    del res
            del past
            torch.cuda.empty_cache()
            decode_ms = statistics.median(steps[1:] if len(steps) > 1 else steps)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rec = {"tokens": n, "median_ms": statistics.median(times), "min_ms": min(times),
               "max_ms": max(times), "reps": reps, "first_token": first, "peak_gib": peak,
               "decode_ms_per_token": decode_ms}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        dec = f", decode {decode_ms:.2f} ms/token" if decode_ms is not None else ""
        print(f"hf: {n} tokens: median {rec['median_ms']:.1f} ms (peak {peak:.1f} GiB){dec}",
              flush=True)


def load(path):
    return {r["tokens"]: r for r in (json.loads(l) for l in open(path) if l.strip())}


def report(ours_path, hf_path, cli_path):
    ours, hf = load(ours_path), load(hf_path)
    cli = {}
    if cli_path:
        for line in open(cli_path):
            parts = line.split()
            if len(parts) == 2:
                cli[int(parts[0])] = float(parts[1])
    print("| S | burst ms | HF ms | HF / burst | burst TFLOP/s | HF TFLOP/s | burst % of 770 |"
          " burst-generate cold ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in sorted(set(ours) | set(hf)):
        o, h = ours.get(s), hf.get(s)
        om = o["median_ms"] if o else float("nan")
        hm = h["median_ms"] if h else float("nan")
        ot = flops(s) / (om * 1e-3) / 1e12
        ht = flops(s) / (hm * 1e-3) / 1e12
        c = f"{cli[s]:.1f}" if s in cli else "-"
        print(f"| {s} | {om:.1f} | {hm:.1f} | {hm / om:.2f} | {ot:.0f} | {ht:.0f} | "
              f"{100 * ot / PEAK_TFLOPS:.0f}% | {c} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384,32768,65536")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="hf_prefill.jsonl")
    ap.add_argument("--report", nargs=2, metavar=("OURS", "HF"))
    ap.add_argument("--cli", default="")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="also time this many greedy decode steps per length")
    args = ap.parse_args()
    if args.report:
        report(args.report[0], args.report[1], args.cli)
        return 0
    bench([int(x) for x in args.lengths.split(",")], args.reps, args.out, args.decode_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
