"""Compares burst's last-position logits with HF transformers on the same model.

Runs on the GPU machine after the GPU test CudaBackendTest.TwoLayer7bShapeMatchesCpu ran with
BURST_HF_DIR=DIR, which leaves in DIR: config.json and model.safetensors (a 2-layer model of
the LLaMA-2-7B shape whose bf16 weights are exactly those LlamaModel::random draws on the CUDA
backend), prompt_ids.txt (300 ids), logits_cuda.f32 (ours, bf16 on the GPU) and logits_cpu.f32
(ours, fp32 on the CPU from the same bf16 weights).

    python3 bench/gpu/hf_compare.py --dir DIR [--out result.json]

HF runs the same weights twice: in fp32 (the reference) and in bf16 with SDPA (what a same-
precision implementation gets). The rule, FlashAttention's: our bf16 error against HF fp32 is
at most twice HF bf16's, in relative l2 and in max abs. Our fp32 CPU result must agree with HF
fp32 to fp32 accuracy (it checks that the model graphs are the same). Exit status 1 on failure.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import LlamaForCausalLM


def errors(ours, ref):
    d = ours.astype(np.float64) - ref.astype(np.float64)
    ref64 = ref.astype(np.float64)
    return {
        "max_abs": float(np.abs(d).max()),
        "max_rel": float(np.abs(d).max() / np.abs(ref64).max()),
        "rel_l2": float(np.linalg.norm(d) / np.linalg.norm(ref64)),
        "argmax_equal": bool(int(ours.argmax()) == int(ref.argmax())),
    }


def hf_logits(model_dir, ids, dtype):
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.cuda().eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    logits = out.logits[0, -1].float().cpu().numpy()
    del model, out
    torch.cuda.empty_cache()
    return logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ids = [int(x) for x in open(os.path.join(args.dir, "prompt_ids.txt")).read().split()]
    ids_t = torch.tensor([ids], dtype=torch.long, device="cuda")
    ours_cuda = np.fromfile(os.path.join(args.dir, "logits_cuda.f32"), dtype=np.float32)
    ours_cpu = np.fromfile(os.path.join(args.dir, "logits_cpu.f32"), dtype=np.float32)
    hf32 = hf_logits(args.dir, ids_t, torch.float32)
    hf16 = hf_logits(args.dir, ids_t, torch.bfloat16)

    res = {
        "tokens": len(ids),
        "ours_cpu_f32_vs_hf_f32": errors(ours_cpu, hf32),
        "hf_bf16_vs_hf_f32": errors(hf16, hf32),
        "ours_cuda_bf16_vs_hf_f32": errors(ours_cuda, hf32),
        "ours_cuda_bf16_vs_hf_bf16": errors(ours_cuda, hf16),
        "max_abs_hf_f32_logit": float(np.abs(hf32).max()),
    }
    naive, ours = res["hf_bf16_vs_hf_f32"], res["ours_cuda_bf16_vs_hf_f32"]
    checks = {
        "cuda rel_l2 <= 2x HF bf16's": ours["rel_l2"] <= 2 * naive["rel_l2"],
        "cuda max_abs <= 2x HF bf16's": ours["max_abs"] <= 2 * naive["max_abs"],
        # fp32 against fp32, different summation orders over k = 4096 / 11008: ~1e-5 relative.
        "cpu fp32 rel_l2 <= 1e-4": res["ours_cpu_f32_vs_hf_f32"]["rel_l2"] <= 1e-4,
    }
    res["checks"] = checks
    print(f"HF compare, 2-layer LLaMA-2-7B shape, {len(ids)} tokens, last-position logits "
          f"(max |logit| {res['max_abs_hf_f32_logit']:.3f}):")
    print(f"| comparison | max abs | max abs / max|ref| | rel l2 | argmax equal |")
    print(f"|---|---:|---:|---:|:---:|")
    for k in ("ours_cpu_f32_vs_hf_f32", "hf_bf16_vs_hf_f32", "ours_cuda_bf16_vs_hf_f32",
              "ours_cuda_bf16_vs_hf_bf16"):
        e = res[k]
        print(f"| {k} | {e['max_abs']:.4g} | {e['max_rel']:.4g} | {e['rel_l2']:.4g} | "
              f"{e['argmax_equal']} |")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
