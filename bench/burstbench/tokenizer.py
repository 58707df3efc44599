# Contract: token counting for exact-length prompts. A Tokenizer counts (async) the way the target
# counts, BOS included (the target's /tokenize or gRPC Tokenize, given by the target's
# server_tokenizer()), or with a local SentencePiece model, which alone also decodes ids.
# choose_tokenizer picks one for a run from --tokenizer; fit_prefix cuts a text to exactly n
# tokens. SentencePiece is imported only when a local model is loaded.
import os

from .common import DEFAULT_SPM, log


class Tokenizer:
    """Counts tokens the way the target counts them (its /tokenize endpoint or gRPC Tokenize,
    BOS included), or with a local SentencePiece model; decodes only with a local model."""

    def __init__(self, count_fn, sp=None, name=""):
        self._count = count_fn
        self.sp = sp
        self.name = name

    async def count(self, text):
        return await self._count(text)

    def decode(self, ids):
        return self.sp.decode([i for i in ids if i > 2]) if self.sp else None


def load_spm(path):
    try:
        import sentencepiece
    except ImportError:
        return None
    if not path or not os.path.exists(path):
        return None
    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(path)
    return sp


def spm_tokenizer(sp, path):
    bos = 1 if sp.bos_id() >= 0 else 0

    async def count(text):
        return len(sp.encode(text)) + bos

    return Tokenizer(count, sp, f"sentencepiece:{path}")


async def fit_prefix(tok, source, n):
    """The prefix of `source` that tokenizes (BOS included) to exactly n tokens, or None when
    no prefix does (a character that adds two tokens at once) or the source is too short.
    Interpolation search on the prefix length in characters: the count grows about linearly."""
    lo, lo_m = 0, 1
    hi, hi_m = None, None
    c = min(len(source), max(1, n * 4))
    for _ in range(60):
        m = await tok.count(source[:c])
        if m == n:
            return source[:c]
        if m < n:
            lo, lo_m = c, m
        else:
            hi, hi_m = c, m
        if hi is None:
            if c >= len(source):
                return None
            c = min(len(source), max(c + 1, int(c * (n / max(m, 1)) * 1.02) + 1))
        else:
            if hi - lo <= 1:
                return None
            guess = lo + int((hi - lo) * (n - lo_m) / max(hi_m - lo_m, 1))
            mid = (lo + hi) // 2
            # Interpolate, but step towards the middle when the bracket shrinks slowly.
            c = min(hi - 1, max(lo + 1, guess if hi - lo > 64 else mid))
    return None


async def choose_tokenizer(args, target, needed):
    if args.tokenizer not in ("auto", "server"):
        # vLLM's --tokenizer names a model: a directory (its tokenizer.model here) or a Hugging
        # Face id, which is no file here: then the tokenizer is chosen as with auto.
        if os.path.isdir(args.tokenizer):
            args.tokenizer = os.path.join(args.tokenizer, "tokenizer.model")
        elif not os.path.exists(args.tokenizer):
            log(f"burst-bench: --tokenizer {args.tokenizer}: no such file (a Hugging Face id?); "
                "choosing as with --tokenizer auto")
            args.tokenizer = "auto"
            return await choose_tokenizer(args, target, needed)
        sp = load_spm(args.tokenizer)
        if sp is None:
            raise SystemExit(f"burst-bench: cannot load --tokenizer {args.tokenizer} (a "
                             "SentencePiece model; Python needs sentencepiece)")
        return spm_tokenizer(sp, args.tokenizer)
    if not needed:
        return None
    tok = await target.server_tokenizer()
    local = load_spm(DEFAULT_SPM)
    if tok is not None:
        tok.sp = local  # decoding random ids into text, when a local model is there
        return tok
    if args.tokenizer == "server":
        raise SystemExit("burst-bench: the target has no tokenize endpoint (--tokenizer server)")
    if local is not None:
        log(f"burst-bench: the target has no tokenize endpoint; counting tokens with "
            f"{DEFAULT_SPM}")
        return spm_tokenizer(local, DEFAULT_SPM)
    raise SystemExit("burst-bench: exact-length text prompts need a tokenizer: the target's "
                     "/tokenize, or --tokenizer FILE (SentencePiece)")
