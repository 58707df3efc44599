#!/usr/bin/env python3
"""Golden fixtures from Hugging Face transformers (run on the GPU machine; its CPU is enough).

For each fixture model, runs transformers.LlamaForCausalLM (eager attention, fp32) on a prompt
and writes OUT/<name>/golden.json: prompt ids, the logits at the last prompt position (prefill),
a 32-token greedy continuation (EOS not special), and the logits of the last decode step.
The engine's tests (tests/unit/golden_test.cpp) must reproduce them.

Fixture models:
  kjv-tiny       the embedded default (models/kjv-tiny), prompt from its real tokenizer
  odd-linear     random weights saved by HF: hidden 96, 3 layers, 6 heads / 2 KV heads,
                 intermediate 200, vocab 4099, rope_scaling linear 2.0, untied head, fp16 weights
  odd-dynamic    random weights saved by HF, sharded (index.json): hidden 64, 2 layers,
                 4 heads / 4 KV heads, head_dim 16, rope_scaling dynamic 2.0 with
                 max_position_embeddings 32 (the prompt and the decode run past it), bf16 weights
  odd-yarn       random weights saved by HF: hidden 128, 2 layers, 4 heads / 2 KV heads,
                 head_dim 32, rope_theta 500, rope_scaling yarn factor 4 over 16 original
                 positions (max_position_embeddings 64; default betas, so the ramp blends
                 rotary pairs 1 and 2 and attention_scaling is 0.1 ln 4 + 1), a 40-token prompt
                 and its decode past the original 16 positions, untied head, bf16 weights

usage: make_golden.py OUT [--only NAME ...]
"""
import argparse
import json
import os
import sys

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 32


def random_model(name, out_dir, dtype, shard, **cfg):
    torch.manual_seed(sum(map(ord, name)))
    config = transformers.LlamaConfig(**cfg)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # HF initialises norms to 1: randomise them too
            p.uniform_(-0.12, 0.12) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    model.save_pretrained(out_dir, max_shard_size="100KB" if shard else "2GB")
    return out_dir


def run(model_dir, prompt):
    model = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = torch.tensor([prompt])
    tokens, decode_logits = [], None
    with torch.no_grad():
        out = model(ids, use_cache=True)
        prefill_logits = out.logits[0, -1].clone()
        past = out.past_key_values
        nxt = int(torch.argmax(prefill_logits))
        for step in range(STEPS):
            tokens.append(nxt)
            if step == STEPS - 1:
                break
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            decode_logits = out.logits[0, -1].clone()
            nxt = int(torch.argmax(decode_logits))
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_ids": prompt,
        "prefill_logits": [float(x) for x in prefill_logits],
        "greedy_tokens": tokens,
        "decode_logits": [float(x) for x in decode_logits],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(8)
    want = lambda n: not a.only or n in a.only  # noqa: E731
    g = torch.Generator().manual_seed(7)
    if want("kjv-tiny"):
        import sentencepiece as spm
        tiny = os.path.join(ROOT, "models", "kjv-tiny")
        sp = spm.SentencePieceProcessor(model_file=os.path.join(tiny, "tokenizer.model"))
        prompt = [1] + sp.encode("In the beginning God created the heaven and the earth. "
                                 "And the earth was without form")
        write(a.out, "kjv-tiny", run(tiny, prompt), None)
    if want("odd-linear"):
        d = random_model("odd-linear", os.path.join(a.out, "odd-linear", "model"), torch.float16,
                         False, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, vocab_size=4099,
                         max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                         rope_scaling={"rope_type": "linear", "factor": 2.0},
                         tie_word_embeddings=False)
        prompt = [1] + torch.randint(3, 4099, (36,), generator=g).tolist()
        write(a.out, "odd-linear", run(d, prompt), d)
    if want("odd-dynamic"):
        d = random_model("odd-dynamic", os.path.join(a.out, "odd-dynamic", "model"),
                         torch.bfloat16, True, hidden_size=64, intermediate_size=100,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         vocab_size=515, max_position_embeddings=32, rms_norm_eps=1e-5,
                         rope_theta=500.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                         tie_word_embeddings=True)
        prompt = [1] + torch.randint(3, 515, (40,), generator=g).tolist()
        write(a.out, "odd-dynamic", run(d, prompt), d)
    if want("odd-yarn"):
        # Its own generator: the prompt does not depend on which fixtures ran before it.
        gy = torch.Generator().manual_seed(11)
        d = random_model("odd-yarn", os.path.join(a.out, "odd-yarn", "model"), torch.bfloat16,
                         False, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=503,
                         max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 16},
                         tie_word_embeddings=False)
        prompt = [1] + torch.randint(3, 503, (39,), generator=gy).tolist()
        write(a.out, "odd-yarn", run(d, prompt), d)


def write(out, name, result, model_dir):
    os.makedirs(os.path.join(out, name), exist_ok=True)
    with open(os.path.join(out, name, "golden.json"), "w") as f:
        json.dump(result, f)
    print(f"{name}: prompt {len(result['prompt_ids'])} tokens, greedy {result['greedy_tokens']}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
