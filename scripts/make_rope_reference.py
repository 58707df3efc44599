#!/usr/bin/env python3
"""HF transformers' own RoPE frequencies for configs the engine must match (run on the GPU
machine, where transformers is installed; its CPU is enough).

For each case, a whole config.json (LlamaForCausalLM) goes through transformers.LlamaConfig
the way from_pretrained reads it, and LlamaRotaryEmbedding gives inv_freq (fp32, head_dim / 2
values) and attention_scaling (the factor HF multiplies cos and sin by). The result is
tests/fixtures/rope/yarn_hf.json, which tests/unit/rope_test.cpp parses with the engine's own
config reader and compares value by value.

usage: make_rope_reference.py OUT.json
"""
import json
import sys

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def config(hidden, heads, max_pos, theta, **extra):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
         "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "num_attention_heads": heads,
         "vocab_size": 32000, "max_position_embeddings": max_pos, "rope_theta": theta}
    c.update(extra)
    return c


CASES = {
    # NousResearch/Yarn-Llama-2-7b-128k as published (transformers 4 spelling, "finetuned").
    "llama2-7b-128k": config(4096, 32, 131072, 10000.0, rope_scaling={
        "factor": 32.0, "original_max_position_embeddings": 4096, "type": "yarn",
        "finetuned": True}),
    # No original_max_position_embeddings anywhere: it is max_position_embeddings.
    "no-original": config(2048, 16, 4096, 10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0}),
    # factor null: transformers 5 derives it as max_position_embeddings / original.
    "derived-factor": config(2048, 32, 16384, 10000.0, rope_parameters={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0}),
    # DeepSeek-style mscale / mscale_all_dim (the attention factor is their ratio).
    "mscale-ratio": config(4096, 32, 163840, 10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # mscale without mscale_all_dim is ignored: 0.1 ln(factor) + 1.
    "mscale-alone": config(4096, 32, 32768, 10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
        "mscale": 0.5}),
    # gpt-oss-style: no truncation of the correction range (fractional ramp ends).
    "no-truncate": config(4096, 64, 131072, 150000.0, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    # Explicit attention_factor and betas, a large theta.
    "explicit-attention": config(8192, 64, 65536, 500000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0}),
    # factor disagrees with max_position_embeddings / original: the explicit factor is used.
    "factor-mismatch": config(4096, 32, 131072, 10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}),
    # original_max_position_embeddings at the top level and inside: which one wins.
    "top-level-original": config(4096, 32, 32768, 10000.0,
                                 original_max_position_embeddings=2048, rope_scaling={
                                     "rope_type": "yarn", "factor": 8.0,
                                     "original_max_position_embeddings": 4096}),
    # The odd-yarn golden fixture's rope (head_dim 32, theta 500, factor 4 over 16).
    "odd-yarn": config(128, 4, 64, 500.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}


def main():
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": {}}
    for name, cfg in CASES.items():
        entry = {"config": cfg}
        try:
            c = transformers.LlamaConfig.from_dict(json.loads(json.dumps(cfg)))
            rope = LlamaRotaryEmbedding(c)
            entry["inv_freq"] = [float(x) for x in rope.inv_freq]
            entry["attention_scaling"] = float(rope.attention_scaling)
            entry["rope_parameters"] = {k: v for k, v in dict(c.rope_parameters).items()}
        except Exception as e:  # noqa: BLE001 -- recorded: a refusal is a result too
            entry["error"] = f"{type(e).__name__}: {e}"
        out["cases"][name] = entry
        print(name, entry.get("attention_scaling"), entry.get("error", ""),
              entry.get("rope_parameters"), file=sys.stderr)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
