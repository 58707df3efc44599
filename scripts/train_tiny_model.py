#!/usr/bin/python3
"""Trains burst's embedded default model: a tiny LLaMA-architecture model on the KJV Bible.

Runs once, on CPU, with Debian's python3-torch (+ libopenblas0-pthread) and the real LLaMA-2
tokenizer; exports a Hugging Face model directory (config.json, model.safetensors written by
scripts/safetensors_writer.py, tokenizer.model, NOTICE). The architecture is exactly
transformers' LlamaForCausalLM (RMSNorm, rotate-half RoPE, GQA, SwiGLU, no biases, tied
embeddings) so HF loads the export unchanged (scripts/make_golden.py checks that).

Training restricts the softmax to the token ids the corpus uses (about 1/5 of the vocabulary)
for speed, then finishes with the full 32000-way softmax so that unused ids get low logits
and sampling at temperature > 0 stays on real words.

usage: train_tiny_model.py --tokenizer tokenizer.model --out models/kjv-tiny [--minutes 40]
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import sentencepiece as spm
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_writer import write_safetensors  # noqa: E402

# head_dim 64 so the CUDA kernels (head dim 64/128) run it too; 2 query heads share 1 KV head.
# Small on purpose: on 2 CPU cores a narrow, deeper model learns more per minute.
CONFIG = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=6,
              num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=2048, vocab_size=32000)


def kjv_chapters():
    """Chapters of the KJV as text, one verse per line (verse numbers dropped)."""
    out = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    chapters, verses = [], []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
        elif line.startswith(" ") or not re.match(r"^\S.* \d+$", line):
            verses[-1] += " " + line.strip()  # wrapped verse continues
        else:
            if verses:
                chapters.append("\n".join(verses))
            verses = []
    if verses:
        chapters.append("\n".join(verses))
    return chapters


def rms_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Tiny(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
        nkv = c["num_key_value_heads"]
        self.embed = torch.nn.Parameter(torch.randn(c["vocab_size"], d) * 0.02)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = torch.nn.ParameterDict({
                "input_layernorm": torch.nn.Parameter(torch.ones(d)),
                "q_proj": torch.nn.Parameter(torch.randn(d, d) * 0.02),
                "k_proj": torch.nn.Parameter(torch.randn(nkv * hd, d) * 0.02),
                "v_proj": torch.nn.Parameter(torch.randn(nkv * hd, d) * 0.02),
                "o_proj": torch.nn.Parameter(torch.randn(d, d) * 0.02 / math.sqrt(2 * c["num_hidden_layers"])),
                "post_attention_layernorm": torch.nn.Parameter(torch.ones(d)),
                "gate_proj": torch.nn.Parameter(torch.randn(f, d) * 0.02),
                "up_proj": torch.nn.Parameter(torch.randn(f, d) * 0.02),
                "down_proj": torch.nn.Parameter(torch.randn(d, f) * 0.02 / math.sqrt(2 * c["num_hidden_layers"])),
            })
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(d))
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def hidden(self, ids):
        c = self.c
        b, t = ids.shape
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["hidden_size"] // nh
        freqs = torch.outer(torch.arange(t).float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed[ids]
        for L in self.layers:
            h = rms_norm(x, L["input_layernorm"], c["rms_norm_eps"])
            q = (h @ L["q_proj"].T).view(b, t, nh, hd).transpose(1, 2)
            k = (h @ L["k_proj"].T).view(b, t, nkv, hd).transpose(1, 2)
            v = (h @ L["v_proj"].T).view(b, t, nkv, hd).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            # Debian's torch 1.13 has no scaled_dot_product_attention: plain causal softmax.
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = torch.softmax(s, dim=-1) @ v
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ L["o_proj"].T
            h = rms_norm(x, L["post_attention_layernorm"], c["rms_norm_eps"])
            x = x + (F.silu(h @ L["gate_proj"].T) * (h @ L["up_proj"].T)) @ L["down_proj"].T
        return rms_norm(x, self.norm, c["rms_norm_eps"])


def export(model, out_dir, tokenizer_path, log):
    os.makedirs(out_dir, exist_ok=True)
    c = dict(CONFIG)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "initializer_range": 0.02, "rope_scaling": None, "torch_dtype": "float32", **c}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tensors = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + "self_attn." + name + ".weight"] = L[name]
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[p + "mlp." + name + ".weight"] = L[name]
        tensors[p + "input_layernorm.weight"] = L["input_layernorm"]
        tensors[p + "post_attention_layernorm.weight"] = L["post_attention_layernorm"]
    # Stored as bf16: half the bytes in git; the engines compute in fp32 from it.
    write_safetensors(os.path.join(out_dir, "model.safetensors"),
                      {k: v.detach().to(torch.bfloat16) for k, v in tensors.items()},
                      metadata={"format": "pt"})
    with open(tokenizer_path, "rb") as src, open(os.path.join(out_dir, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    with open(os.path.join(out_dir, "training_log.txt"), "w") as f:
        f.write("\n".join(log) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--full-vocab-fraction", type=float, default=0.2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--checkpoint", help="save/resume training state here (resumes if present)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(os.cpu_count() or 2)

    sp = spm.SentencePieceProcessor(model_file=a.tokenizer)
    stream = []
    for ch in kjv_chapters():
        stream += [1] + sp.encode(ch) + [2]
    data = torch.tensor(stream, dtype=torch.long)
    used = torch.unique(data)
    remap = torch.full((CONFIG["vocab_size"],), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    print(f"corpus: {len(data)} tokens, {len(used)} distinct ids", flush=True)

    model = Tiny(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    budget = a.minutes * 60
    log, step, ema, done = [], 0, None, 0.0
    if a.checkpoint and os.path.exists(a.checkpoint):
        st = torch.load(a.checkpoint)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        log, step, ema, done = st["log"], st["step"], st["ema"], st["elapsed"]
        print(f"resumed at step {step}, {done:.0f}s trained", flush=True)
    start = time.time() - done
    saved = time.time()
    while True:
        elapsed = time.time() - start
        if a.checkpoint and time.time() - saved > 120:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "log": log,
                        "step": step, "ema": ema, "elapsed": elapsed}, a.checkpoint)
            saved = time.time()
        frac = elapsed / budget
        if frac >= 1.0:
            break
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, len(data) - a.seq - 1, (a.batch,))
        x = torch.stack([data[i:i + a.seq] for i in ix])
        y = torch.stack([data[i + 1:i + a.seq + 1] for i in ix])
        h = model.hidden(x)
        full = frac >= 1.0 - a.full_vocab_fraction
        if full:
            loss = F.cross_entropy((h @ model.embed.T).view(-1, CONFIG["vocab_size"]), y.view(-1))
        else:
            logits = h @ model.embed[used].T
            loss = F.cross_entropy(logits.view(-1, len(used)), remap[y].view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            line = (f"step {step} t={elapsed:.0f}s lr={lr:.2e} loss={ema:.3f} "
                    f"softmax={'full' if full else 'corpus'}")
            print(line, flush=True)
            log.append(line)
        step += 1
    export(model, a.out, a.tokenizer, log)
    print(f"exported to {a.out} after {step} steps, loss {ema:.3f}", flush=True)


if __name__ == "__main__":
    main()
