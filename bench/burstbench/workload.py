# Contract: the requests of a run, as Specs (warm-ups first): build_specs(args, rng, tok,
# wants_text, total) gives prompts of the requested lengths (--input-len, --input-len-range,
# --input-lens, a --long-fraction mix with groups short / long) as random token ids, random text
# or KJV / text-file slices cut to exact token counts, or the rows of a JSONL file; or the
# prefix-repetition workload (prefix_repetition_specs: D shared random prefixes, each request
# one of them + a fresh random suffix; warm-ups get prompts of their own, so that they leave no
# shared prefix in the server's cache). All the randomness comes from rng (the run's seed).
# Errors in the inputs end the run (SystemExit).
import json
import subprocess

from .common import Spec, log
from .kjv import kjv_verses
from .tokenizer import fit_prefix

WORDS = ("the and of to in that he shall unto for i his a lord they be is him not them it with "
         "all thou was god which my me said but ye their have will thee from as are when this "
         "out were by upon man people king house day hand land son children come went there "
         "one up came israel before then made also say against into earth").split()


def kjv_corpus():
    """The King James Bible from Debian's bible-kjv (`bible`), one verse per line, the verse
    numbers dropped (as scripts/train_tiny_model.py reads it)."""
    try:
        out = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit("burst-bench: --dataset-name kjv needs the `bible` command (Debian "
                         f"package bible-kjv) or use --dataset-name text --dataset-path FILE: {e}")
    return "\n".join(kjv_verses(out))  # chapter headings as blank lines


def input_lengths(args, rng, n):
    """The requested input length of each of n requests and its group."""
    if args.input_lens:
        base = [args.input_lens[i % len(args.input_lens)] for i in range(n)]
    elif args.input_len_range:
        lo, hi = args.input_len_range
        base = [rng.randint(lo, hi) for _ in range(n)]
    else:
        base = [args.input_len] * n
    groups = ["all"] * n
    if args.long_fraction > 0:
        k = round(args.long_fraction * n)
        if args.long_fraction > 0 and k == 0 and n > 0:
            k = 1
        longs = set(rng.sample(range(n), k))
        groups = ["long" if i in longs else "short" for i in range(n)]
        base = [args.long_len if i in longs else base[i] for i in range(n)]
    return base, groups


def random_ids(rng, n, args):
    lo, hi = args.token_id_range
    body = rng.choices(range(lo, hi), k=n - (1 if args.bos_id >= 0 else 0))
    return ([args.bos_id] if args.bos_id >= 0 else []) + body


async def random_text(rng, n, args, tok):
    """Random text of exactly n tokens: random ids decoded with a local tokenizer when there is
    one, else random common words; cut to the exact count with the tokenizer."""
    for _ in range(8):
        if tok.sp is not None:
            source = tok.decode(random_ids(rng, n * 2 + 16, args))
        else:
            source = " ".join(rng.choice(WORDS) for _ in range(n * 2 + 16))
        text = await fit_prefix(tok, source, n)
        if text is not None:
            return text
    raise SystemExit(f"burst-bench: could not build random text of exactly {n} tokens")


async def corpus_text(rng, n, corpus, tok):
    """A slice of the corpus, from a random offset (wrapping around), of exactly n tokens."""
    need = n * 8 + 64
    for _ in range(8):
        start = rng.randrange(len(corpus))
        source = corpus[start:start + need]
        while len(source) < need:
            source += "\n" + corpus[:need - len(source)]
        text = await fit_prefix(tok, source.lstrip(), n)
        if text is not None:
            return text
    raise SystemExit(f"burst-bench: could not cut the corpus to exactly {n} tokens")


async def prefix_repetition_specs(args, rng, tok, wants_text):
    """vLLM's prefix_repetition dataset: D random prefixes of P tokens (BOS included), each
    request one of them (each prefix as often as the others, within one; in an order shuffled
    with the seed, or round robin) followed by a fresh random suffix of S tokens. Token ids:
    exactly P + S tokens; text: the prefix and the suffix cut to P and S tokens apiece, the
    length the count of the whole prompt. Warm-ups first, with prompts that share nothing."""
    plen, slen = args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len
    nprefix, out_len = args.prefix_repetition_num_prefixes, args.output_len
    lo, hi = args.token_id_range

    async def piece(n, first):
        if n == 0:
            return "" if wants_text else []
        if wants_text:
            return await random_text(rng, n + (0 if first else 1), args, tok)
        return random_ids(rng, n, args) if first else rng.choices(range(lo, hi), k=n)

    specs = []
    for i in range(args.num_warmups):
        head, tail = await piece(plen, True), await piece(slen, False)
        specs.append((head, tail, "warmup"))
    prefixes = [await piece(plen, True) for _ in range(nprefix)]
    order = [i % nprefix for i in range(args.num_requests)]
    if args.prefix_repetition_order == "random":
        rng.shuffle(order)
    for k in order:
        specs.append((prefixes[k], await piece(slen, False), f"prefix{k}"))
    out = []
    for i, (head, tail, g) in enumerate(specs):
        if wants_text:
            text = head + (" " + tail if tail else "")
            out.append(Spec(i, await tok.count(text), out_len, "warmup" if g == "warmup"
                            else "all", text=text))
        else:
            out.append(Spec(i, len(head) + len(tail), out_len,
                            "warmup" if g == "warmup" else "all", ids=head + tail))
        out[-1].prefix = None if g == "warmup" else int(g[6:])
    return out


async def build_specs(args, rng, tok, wants_text, total):
    """The requests of the run (warm-ups first)."""
    if args.dataset_name == "prefix-repetition":
        return await prefix_repetition_specs(args, rng, tok, wants_text)
    specs = []
    if args.dataset_name == "jsonl":
        rows = []
        with open(args.dataset_path) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"burst-bench: {args.dataset_path}:{line_no}: {e}")
        if not rows:
            raise SystemExit(f"burst-bench: {args.dataset_path} has no prompts")
        for i in range(total):
            row = rows[i % len(rows)]
            prompt = row.get("prompt", row.get("text"))
            out_len = int(row.get("output_len", row.get("max_tokens", args.output_len)))
            if isinstance(prompt, list):
                if wants_text:
                    raise SystemExit("burst-bench: token-id prompts need --endpoint "
                                     "/v1/completions or --grpc")
                specs.append(Spec(i, len(prompt), out_len, "all", ids=prompt))
            elif isinstance(prompt, str):
                n = await tok.count(prompt) if tok else None
                specs.append(Spec(i, n, out_len, "all", text=prompt))
            else:
                raise SystemExit(f"burst-bench: {args.dataset_path}: each line needs a "
                                 "\"prompt\" (a string or a list of token ids)")
        return specs
    lens, groups = input_lengths(args, rng, args.num_requests)
    if args.num_warmups:  # warm-ups take the run's first lengths, so the run's pattern holds
        lens = [lens[i % len(lens)] if lens else args.input_len
                for i in range(args.num_warmups)] + lens
        groups = ["warmup"] * args.num_warmups + groups
    corpus = None
    if args.dataset_name == "kjv":
        corpus = kjv_corpus()
    elif args.dataset_name == "text":
        with open(args.dataset_path, encoding="utf-8", errors="replace") as f:
            corpus = f.read()
    for i, (n, g) in enumerate(zip(lens, groups)):
        if corpus is not None:
            text = await corpus_text(rng, n, corpus, tok)
            if not wants_text and args.prompt_format == "ids" and tok.sp is not None:
                ids = tok.sp.encode(text)
                specs.append(Spec(i, n, args.output_len, g, ids=[1] + ids))
            else:
                specs.append(Spec(i, n, args.output_len, g, text=text))
        elif wants_text:
            specs.append(Spec(i, n, args.output_len, g, text=await random_text(rng, n, args, tok)))
        else:
            specs.append(Spec(i, n, args.output_len, g, ids=random_ids(rng, n, args)))
        if total >= 20 and (i + 1) % max(1, total // 10) == 0 and not args.no_progress:
            log(f"burst-bench: built {i + 1}/{total} prompts")
    return specs
