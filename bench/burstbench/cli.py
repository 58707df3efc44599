# Contract: burst-bench's command line. parse_args(argv) returns the argparse Namespace (flags,
# defaults and help as documented in --help; --report skips the run's checks; a bad
# combination exits with argparse's usage error, code 2; --dataset-name prefix_repetition is
# read as prefix-repetition, whose lengths then stand in --input-len and --output-len);
# vLLM bench serve's flag names are aliases (vllm_aliases: --backend, --host / --port,
# --random-input-len / -output-len / -range-ratio, --save-result with --result-dir /
# --result-filename, --served-model-name, --disable-tqdm, ...); parse_count / parse_range /
# parse_list / key_value are the value parsers; parse_goodput turns --goodput's METRIC:MS items
# into {metric: ms}.
import argparse
import json
import os

from . import __doc__ as TOOL_DOC
from .common import ROOT


def parse_count(s):
    """'4096', '4K', '4k' (x1024), '1M' (x1048576) -> int."""
    s = str(s).strip()
    mult = 1
    if s[-1:] in ("k", "K"):
        mult, s = 1024, s[:-1]
    elif s[-1:] in ("m", "M"):
        mult, s = 1024 * 1024, s[:-1]
    v = int(float(s) * mult)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: must be > 0")
    return v


def parse_count0(s):
    """parse_count, 0 allowed."""
    return 0 if str(s).strip() == "0" else parse_count(s)


def parse_range(s):
    lo, _, hi = s.partition(":")
    if not hi:
        raise argparse.ArgumentTypeError(f"{s!r}: expected LO:HI")
    lo, hi = parse_count(lo), parse_count(hi)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"{s!r}: LO > HI")
    return lo, hi


def parse_list(s):
    return [parse_count(x) for x in s.split(",") if x.strip()]


def key_value(s):
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"{s!r}: expected KEY=VALUE")
    return tuple(s.split("=", 1))


def parse_goodput(items):
    slos = {}
    for it in items or []:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise SystemExit(f"burst-bench: --goodput {it!r}: expected ttft:MS, tpot:MS or "
                             "e2el:MS")
        slos[k] = float(v)
    return slos


# vLLM's --backend / --endpoint-type: the endpoint it implies (burst has no other protocol
# over HTTP; its own gRPC API is --grpc).
VLLM_BACKENDS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                 "openai-chat": "/v1/chat/completions"}


def add_vllm_aliases(p):
    """vLLM bench serve's names for what burst-bench has, so its command lines run here."""
    v = p.add_argument_group(
        "vLLM bench serve's flags",
        "accepted as in `vllm bench serve`: --num-prompts, --max-concurrency, --dataset-name "
        "random, --request-rate, --burstiness, --seed, --ignore-eos, --goodput, --metadata, "
        "--metric-percentiles, --label, --temperature, --top-p, --top-k are burst-bench's own "
        "names too")
    v.add_argument("--backend", "--endpoint-type", dest="vllm_backend",
                   choices=sorted(VLLM_BACKENDS),
                   help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions")
    v.add_argument("--host", help="with --port: --base-url http://HOST:PORT")
    v.add_argument("--port", type=int, help="with --host (default 127.0.0.1): the server's port")
    v.add_argument("--random-input-len", type=parse_count, dest="random_input_len",
                   help="--input-len")
    v.add_argument("--random-output-len", type=parse_count, dest="random_output_len",
                   help="--output-len")
    v.add_argument("--random-range-ratio", type=float, default=None,
                   help="prompt lengths uniform in [L(1-R), L(1+R)] for --input-len L (output "
                        "lengths stay --output-len)")
    v.add_argument("--random-prefix-len", type=int, default=0,
                   help="only 0 (a shared prefix: --dataset-name prefix-repetition)")
    v.add_argument("--save-result", action="store_true",
                   help="write the result JSON to --result-dir / --result-filename")
    v.add_argument("--save-detailed", action="store_true",
                   help="no effect: the result JSON always holds the per-request arrays")
    v.add_argument("--result-dir", help="where --save-result writes (default: .)")
    v.add_argument("--result-filename",
                   help="the --save-result file name (default: vLLM's "
                        "BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    v.add_argument("--served-model-name", help="--model")
    v.add_argument("--disable-tqdm", action="store_true", help="--no-progress")
    v.add_argument("--ready-check-timeout-sec", type=float, help="--wait-ready")
    v.add_argument("--percentile-metrics", default=None,
                   help="no effect: the summary and the JSON hold every metric (ttft, tpot, "
                        "itl, e2el)")
    v.add_argument("--trust-remote-code", action="store_true", help="no effect")


def apply_vllm_aliases(p, a):
    """Folds vLLM's flags into burst-bench's; a value given both ways must agree."""
    def both(name, ours, theirs, default):
        if theirs is None:
            return ours
        if ours != default and ours != theirs:
            p.error(f"{name} and its vLLM alias disagree ({ours} against {theirs})")
        return theirs

    if a.vllm_backend:
        want = VLLM_BACKENDS[a.vllm_backend]
        if a.endpoint != "/v1/completions" and a.endpoint != want:
            p.error(f"--backend {a.vllm_backend} means --endpoint {want}, not {a.endpoint}")
        a.endpoint = want
    if a.host is not None or a.port is not None:
        if a.base_url or a.grpc:
            p.error("--host / --port stand for --base-url: give one of them")
        a.base_url = f"http://{a.host or '127.0.0.1'}:{a.port or 8000}"
    a.input_len = both("--input-len", a.input_len, a.random_input_len, 1024)
    a.output_len = both("--output-len", a.output_len, a.random_output_len, 128)
    if a.random_range_ratio is not None:
        r = a.random_range_ratio
        if not 0 <= r < 1:
            p.error("--random-range-ratio must be in [0, 1)")
        if a.input_lens or a.input_len_range:
            p.error("--random-range-ratio goes with --input-len (or --random-input-len)")
        if r > 0:
            a.input_len_range = (max(1, int(a.input_len * (1 - r))), int(a.input_len * (1 + r)))
    if a.random_prefix_len:
        p.error("--random-prefix-len is not supported: --dataset-name prefix-repetition shares "
                "prefixes (--prefix-repetition-prefix-len)")
    if a.served_model_name:
        a.model = both("--model", a.model, a.served_model_name, None)
    if a.disable_tqdm:
        a.no_progress = True
    if a.ready_check_timeout_sec is not None:
        a.wait_ready = a.ready_check_timeout_sec
    if a.save_result and a.result_json:
        p.error("--save-result and --result-json both name the result file: give one")
    if (a.result_dir or a.result_filename) and not a.save_result:
        p.error("--result-dir and --result-filename go with --save-result")


def save_result_path(a, model, backend):
    """Where --save-result writes: --result-dir / (--result-filename, else vLLM's name)."""
    name = a.result_filename
    if not name:
        import datetime
        rate = "inf" if a.request_rate == float("inf") else f"{a.request_rate:g}"
        conc = f"-concurrency{a.max_concurrency}" if a.max_concurrency else ""
        model_id = (model or "model").split("/")[-1]
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{a.label or a.vllm_backend or backend}-{rate}qps{conc}-{model_id}-{date}.json"
    return os.path.join(a.result_dir or ".", name)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="burst-bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load generator for burst (gRPC or HTTP) and any OpenAI-compatible server.",
        epilog=TOOL_DOC.split("\n\n", 1)[1])
    t = p.add_argument_group("target")
    t.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    t.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    t.add_argument("--grpc", metavar="HOST:PORT", help="burst's gRPC API (burst.v1.Burst)")
    t.add_argument("--api-key", default=os.environ.get("BURST_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $BURST_API_KEY)")
    t.add_argument("--model", help="model name to send (default: the server's first model)")
    t.add_argument("--proto-dir", default=os.path.join(ROOT, "proto"),
                   help="where burst/v1/burst.proto is (for --grpc)")
    t.add_argument("--wait-ready", type=float, default=0, metavar="S",
                   help="wait up to S seconds for the server's /health (gRPC: ModelInfo)")
    t.add_argument("--request-timeout", type=float, default=3600.0, metavar="S")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random",
                   choices=["random", "kjv", "text", "jsonl", "prefix-repetition",
                            "prefix_repetition"],
                   help="random token ids (default), the KJV text (Debian bible-kjv), a text "
                        "file (--dataset-path) cut to exact lengths, a JSONL file of "
                        "{\"prompt\": str | [ids], \"output_len\": n}, or shared prefixes "
                        "(prefix-repetition, vLLM's prefix_repetition: --prefix-repetition-*)")
    w.add_argument("--dataset-path")
    w.add_argument("--input-len", type=parse_count, default=1024,
                   help="exact prompt length in tokens, BOS included (4K = 4096)")
    w.add_argument("--input-len-range", type=parse_range, metavar="LO:HI",
                   help="uniformly random prompt lengths")
    w.add_argument("--input-lens", type=parse_list, metavar="A,B,...",
                   help="a list of prompt lengths, used in turn")
    w.add_argument("--long-fraction", type=float, default=0.0,
                   help="mixed workload: this share of the requests has --long-len tokens")
    w.add_argument("--long-len", type=parse_count, default=32768)
    w.add_argument("--output-len", type=parse_count, default=128, help="max_tokens")
    w.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --output-len tokens (vLLM's ignore_eos: EOS does not "
                        "end a request; a server that ends some early anyway gets a warning)")
    w.add_argument("--prompt-format", default="auto", choices=["auto", "ids", "text"],
                   help="send token ids (completions and gRPC accept them; auto: ids for "
                        "random, text for kjv/text) or text")
    w.add_argument("--tokenizer", default="auto",
                   help="'server' (the target's /tokenize or Tokenize), or a SentencePiece "
                        "model file or a model directory holding one (auto: the server's, else "
                        "models/kjv-tiny/tokenizer.model); a name that is no file (vLLM's "
                        "Hugging Face id) counts as auto")
    w.add_argument("--token-id-range", type=parse_range, default=(259, 32000), metavar="LO:HI",
                   help="random token ids are drawn from [LO, HI) (default 259:32000, LLaMA-2)")
    w.add_argument("--bos-id", type=int, default=1,
                   help="first id of a random-id prompt (-1: none)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--top-p", type=float)
    w.add_argument("--top-k", type=int)
    w.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every HTTP request body")
    pr = p.add_argument_group(
        "prefix-repetition workload",
        "D random prefixes of P tokens (BOS included); each request is one of them followed by "
        "a fresh random suffix of S tokens, P + S in all; each prefix serves N / D requests")
    pr.add_argument("--prefix-repetition-prefix-len", type=parse_count, default=256,
                    metavar="P", help="tokens of each shared prefix, BOS included (default 256)")
    pr.add_argument("--prefix-repetition-suffix-len", type=parse_count0, default=256,
                    metavar="S", help="tokens of each request's own suffix (default 256)")
    pr.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, metavar="D",
                    help="distinct prefixes (default 10; at most --num-prompts)")
    pr.add_argument("--prefix-repetition-output-len", type=parse_count, default=None,
                    metavar="O", help="max_tokens (default: --output-len)")
    pr.add_argument("--prefix-repetition-order", default="random",
                    choices=["random", "round-robin"],
                    help="which prefix each request gets: shuffled with --seed (default), or "
                         "0, 1, ..., D-1, 0, ...")
    ld = p.add_argument_group("load")
    ld.add_argument("--num-requests", "--num-prompts", type=int, default=100)
    ld.add_argument("--max-concurrency", type=int, default=None)
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s, Poisson (gamma with --burstiness) arrivals; inf: all at once")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival times: 1 Poisson, <1 burstier")
    ld.add_argument("--num-warmups", type=int, default=0)
    ld.add_argument("--seed", type=int, default=None,
                    help="workload seed (default: a fresh one per run, printed and saved)")
    r = p.add_argument_group("results")
    r.add_argument("--result-json", metavar="FILE")
    r.add_argument("--label")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", type=key_value,
                   help="saved in the result JSON's metadata")
    r.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    r.add_argument("--metric-percentiles", default="90,99",
                   type=lambda s: [float(x) for x in s.split(",")])
    r.add_argument("--plot", metavar="DIR", help="write PNG plots there (matplotlib)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--report", nargs="+", metavar="JSON",
                   help="no run: combine result files into a table (--markdown) and --plot")
    r.add_argument("--markdown", metavar="FILE", help="with --report: write the table there")
    add_vllm_aliases(p)
    a = p.parse_args(argv)
    if a.report:
        return a
    apply_vllm_aliases(p, a)
    if bool(a.base_url) == bool(a.grpc):
        p.error("give exactly one of --base-url URL and --grpc HOST:PORT")
    if a.grpc and "chat" in a.endpoint:
        p.error("--endpoint is for --base-url")
    if a.dataset_name in ("jsonl", "text") and not a.dataset_path:
        p.error(f"--dataset-name {a.dataset_name} needs --dataset-path")
    if not 0 <= a.long_fraction <= 1:
        p.error("--long-fraction must be in [0, 1]")
    if a.num_requests < 0 or a.num_warmups < 0:
        p.error("--num-requests and --num-warmups must be >= 0")
    if a.request_rate <= 0 or a.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    if a.max_concurrency is not None and a.max_concurrency <= 0:
        p.error("--max-concurrency must be > 0")
    if not isinstance(a.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    if a.dataset_name == "prefix_repetition":
        a.dataset_name = "prefix-repetition"
    if a.dataset_name == "prefix-repetition":
        if a.input_lens or a.input_len_range or a.long_fraction > 0:
            p.error("--dataset-name prefix-repetition takes its lengths from "
                    "--prefix-repetition-prefix-len and -suffix-len")
        if a.prefix_repetition_num_prefixes < 1:
            p.error("--prefix-repetition-num-prefixes must be >= 1")
        if a.num_requests < a.prefix_repetition_num_prefixes:
            p.error(f"--num-prompts ({a.num_requests}) must be >= "
                    f"--prefix-repetition-num-prefixes ({a.prefix_repetition_num_prefixes})")
        a.input_len = a.prefix_repetition_prefix_len + a.prefix_repetition_suffix_len
        if a.prefix_repetition_output_len is not None:
            a.output_len = a.prefix_repetition_output_len
    return a
