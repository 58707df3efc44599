#!/usr/bin/python3
"""Trains burst's embedded default model: a tiny LLaMA-architecture model on the KJV Bible.

Trains on a GPU (`--device cuda`: torch 2.x, bf16 autocast, a few minutes on an H100) or, slowly,
on CPU with Debian's python3-torch (+ libopenblas0-pthread); the real LLaMA-2 tokenizer; exports
a Hugging Face model directory (config.json, model.safetensors written by
scripts/safetensors_writer.py, tokenizer.model, training_log.txt). The architecture is exactly
transformers' LlamaForCausalLM (RMSNorm, rotate-half RoPE, GQA, SwiGLU, no biases, tied
embeddings) so HF loads the export unchanged (scripts/make_golden.py checks that).

The corpus is the KJV from Debian's bible-kjv (`bible`); a machine without it (the GPU machine)
reads the text that `--dump-corpus FILE` wrote here (`--corpus FILE`). On CPU, training first
restricts the softmax to the token ids the corpus uses (about 1/5 of the vocabulary) for speed,
then finishes with the full 32000-way softmax so that unused ids get low logits and sampling at
temperature > 0 stays on real words; on a GPU the full softmax is cheap and used throughout.
The last 1 % of the chapters are held out: the log reports their loss beside the training loss.

usage: train_tiny_model.py --dump-corpus kjv.txt                      (where `bible` exists)
       train_tiny_model.py --device cuda --corpus kjv.txt --tokenizer tokenizer.model \
                           --out models/kjv-tiny --minutes 4 --seed 1234
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

try:  # --dump-corpus needs neither
    import sentencepiece as spm
    import torch
    import torch.nn.functional as F
except ImportError:
    spm = torch = F = None


# head_dim 128, the 7B's, so a real trained model runs the Hopper kernel; 2 query heads share
# 1 KV head (GQA). Small on purpose: the CPU tests run it many times on 2 cores, and the
# directory stays under 25 MB (the tied 32000 x 256 embedding is 16 MB of it in bf16).
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
              num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=4096, vocab_size=32000)
CHAPTER_SEP = "\n\n"


def kjv_chapters(corpus=None):
    """Chapters of the KJV as text, one verse per line (verse numbers dropped)."""
    if corpus:
        with open(corpus, encoding="utf-8") as f:
            return [c for c in f.read().split(CHAPTER_SEP) if c.strip()]
    out = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from burstbench.kjv import kjv_chapters as parse_chapters
    return parse_chapters(out)


def rms_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Tiny(torch.nn.Module if torch else object):
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
        freqs = torch.outer(torch.arange(t, device=ids.device).float(), self.inv_freq)
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
            if hasattr(F, "scaled_dot_product_attention"):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # Debian's torch 1.13: plain causal softmax
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1),
                                  float("-inf"))
                a = torch.softmax(s, dim=-1) @ v
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ L["o_proj"].T
            h = rms_norm(x, L["post_attention_layernorm"], c["rms_norm_eps"])
            x = x + (F.silu(h @ L["gate_proj"].T) * (h @ L["up_proj"].T)) @ L["down_proj"].T
        return rms_norm(x, self.norm, c["rms_norm_eps"])


def export(model, out_dir, tokenizer_path, log):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from safetensors_writer import write_safetensors
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
                      {k: v.detach().to("cpu", torch.bfloat16) for k, v in tensors.items()},
                      metadata={"format": "pt"})
    with open(tokenizer_path, "rb") as src, open(os.path.join(out_dir, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    with open(os.path.join(out_dir, "training_log.txt"), "w") as f:
        f.write("\n".join(log) + "\n")


def batches(data, seq, batch, device):
    ix = torch.randint(0, len(data) - seq - 1, (batch,))
    x = torch.stack([data[i:i + seq] for i in ix]).to(device)
    y = torch.stack([data[i + 1:i + seq + 1] for i in ix]).to(device)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump-corpus", metavar="FILE", help="write the KJV text for --corpus; exit")
    ap.add_argument("--corpus", metavar="FILE", help="the text --dump-corpus wrote (else `bible`)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--minutes", type=float, default=None,
                    help="training time (default 4 on cuda, 60 on cpu)")
    ap.add_argument("--full-vocab-fraction", type=float, default=None,
                    help="last fraction of the time with the full softmax (1 on cuda, 0.2 on cpu)")
    ap.add_argument("--seq", type=int, default=None, help="window (2048 on cuda, 512 on cpu)")
    ap.add_argument("--batch", type=int, default=None, help="windows a step (32 cuda, 8 cpu)")
    ap.add_argument("--checkpoint", help="save/resume training state here (resumes if present)")
    ap.add_argument("--lr", type=float, default=None, help="peak (2e-3 cuda, 3e-3 cpu)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.dump_corpus:
        with open(a.dump_corpus, "w", encoding="utf-8") as f:
            f.write(CHAPTER_SEP.join(kjv_chapters()))
        return
    if not a.tokenizer or not a.out:
        ap.error("--tokenizer and --out are required to train")
    gpu = a.device.startswith("cuda")
    pick = lambda v, g, c: v if v is not None else (g if gpu else c)  # noqa: E731
    minutes, full_frac = pick(a.minutes, 4.0, 60.0), pick(a.full_vocab_fraction, 1.0, 0.2)
    seq, batch, peak = pick(a.seq, 2048, 512), pick(a.batch, 32, 8), pick(a.lr, 2e-3, 3e-3)
    torch.manual_seed(a.seed)
    torch.set_num_threads(os.cpu_count() or 2)

    sp = spm.SentencePieceProcessor(model_file=a.tokenizer)
    chapters = kjv_chapters(a.corpus)
    held = max(1, len(chapters) // 100)
    encode = lambda chs: torch.tensor(  # noqa: E731
        [t for ch in chs for t in [1] + sp.encode(ch) + [2]], dtype=torch.long)
    data, valid = encode(chapters[:-held]), encode(chapters[-held:])
    used = torch.unique(torch.cat([data, valid]))
    remap = torch.full((CONFIG["vocab_size"],), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    remap_d, used_d = remap.to(a.device), used.to(a.device)
    print(f"corpus: {len(data)} tokens ({len(valid)} held out), {len(used)} distinct ids",
          flush=True)

    model = Tiny(CONFIG).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    log, step, ema, done = [], 0, None, 0.0
    if a.checkpoint and os.path.exists(a.checkpoint):
        st = torch.load(a.checkpoint)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        log, step, ema, done = st["log"], st["step"], st["ema"], st["elapsed"]
        print(f"resumed at step {step}, {done:.0f}s trained", flush=True)
    log.insert(0, f"device {torch.cuda.get_device_name() if gpu else 'cpu'}, torch "
                  f"{torch.__version__}, seed {a.seed}, {minutes} min, window {seq} x {batch}, "
                  f"lr {peak}, config {json.dumps(CONFIG)}") if step == 0 else None
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if gpu
                else torch.autocast("cpu", enabled=False))

    def loss_of(x, y, full):
        with autocast:
            h = model.hidden(x)
            if full:
                logits = h @ model.embed.T
                return F.cross_entropy(logits.float().view(-1, CONFIG["vocab_size"]), y.view(-1))
            logits = h @ model.embed[used_d].T
            return F.cross_entropy(logits.float().view(-1, len(used)), remap_d[y].view(-1))

    def held_out_loss():
        with torch.no_grad():
            n = min(len(valid) - 1, seq * 4)
            x, y = valid[:n].view(1, -1).to(a.device), valid[1:n + 1].view(1, -1).to(a.device)
            return sum(loss_of(x[:, i:i + seq], y[:, i:i + seq], True).item()
                       for i in range(0, n - seq + 1, seq)) / max(1, n // seq)

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
        lr = peak * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches(data, seq, batch, a.device)
        full = frac >= 1.0 - full_frac
        loss = loss_of(x, y, full)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % (200 if gpu else 50) == 0:
            line = (f"step {step} t={elapsed:.0f}s lr={lr:.2e} loss={ema:.3f} "
                    f"held-out={held_out_loss():.3f} softmax={'full' if full else 'corpus'}")
            print(line, flush=True)
            log.append(line)
        step += 1
    line = (f"end: {step} steps, {step * seq * batch / len(data):.1f} epochs, "
            f"loss {ema:.3f}, held-out {held_out_loss():.3f}")
    print(line, flush=True)
    log.append(line)
    export(model, a.out, a.tokenizer, log)
    print(f"exported to {a.out}", flush=True)


if __name__ == "__main__":
    main()
