# Contract: what a run or --report leaves behind, apart from plots. result_json: the result
# record (run metadata, metrics.compute's fields, per-request arrays with vLLM's names, burst's
# server timings, the prefix cache: hit rate from usage, and from the server's /metrics
# counters over the run where it has them, --metadata);
# print_summary: vLLM's "Serving Benchmark Result" block on stdout;
# markdown_table and report(paths, markdown, plotdir): the --report command (table on stdout,
# --markdown file, --plot), exit code 0.
import datetime
import json
import math
import os

from .common import SERVER_TIMINGS, log
from .metrics import compute, group_metrics, ok_rows, tpot_of
from .plots import plot

METRICS = ["ttft", "tpot", "itl", "e2el"]
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def result_json(results, duration, args, goodput, target, tokenizer, seed, interrupted,
                cache_counters=None):
    """cache_counters: ((queries, hits) before the run, after it) of the server's /metrics, or
    None."""
    m = compute(results, duration, args, goodput)
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": target.backend,
        "endpoint_type": target.backend,
        "base_url": args.base_url,
        "endpoint": args.endpoint if target.kind == "http" else "burst.v1.Burst/Generate",
        "grpc": args.grpc,
        "model_id": target.model,
        "tokenizer_id": tokenizer.name if tokenizer else None,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_requests,
        "num_warmups": args.num_warmups,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "input_len": None if args.input_lens or args.input_len_range else args.input_len,
        "input_lens_requested": args.input_lens,
        "input_len_range": list(args.input_len_range) if args.input_len_range else None,
        "long_fraction": args.long_fraction,
        "long_len": args.long_len if args.long_fraction > 0 else None,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": seed,
        "interrupted_run": interrupted,
    }
    if args.dataset_name == "prefix-repetition":
        out.update({"prefix_repetition_prefix_len": args.prefix_repetition_prefix_len,
                    "prefix_repetition_suffix_len": args.prefix_repetition_suffix_len,
                    "prefix_repetition_num_prefixes": args.prefix_repetition_num_prefixes,
                    "prefix_repetition_output_len": args.output_len,
                    "prefix_repetition_order": args.prefix_repetition_order})
    out.update(m)
    q = h = rate = None
    if cache_counters and cache_counters[0] and cache_counters[1]:
        (q0, h0), (q1, h1) = cache_counters
        q, h = int(q1 - q0), int(h1 - h0)
        rate = h / q if q > 0 else None
    out.update({"server_prefix_cache_queries": q, "server_prefix_cache_hits": h,
                "server_prefix_cache_hit_rate": rate})
    out["groups_summary"] = group_metrics(results, duration, args)
    out.update({
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itls for r in results],
        "e2els": [r.e2el for r in results],
        "tpots": [tpot_of(r) for r in results],
        "start_times": [r.start for r in results],
        "groups": [r.group for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "server_input_lens": [r.server_input_len for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "prefixes": [r.prefix for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [(f"{r.error_kind}: {r.error}" if r.error_kind else "") for r in results],
        "error_kinds": [r.error_kind for r in results],
    })
    for key in SERVER_TIMINGS:
        out[f"server_{key}"] = [r.timings.get(key) if r.timings else None for r in results]
    out["metadata"] = dict(args.metadata)
    return out


def print_summary(j, args):
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(name, v, fmt="{:.2f}"):
        lines.append(f"{name:<40}{fmt.format(v) if isinstance(v, float) else v:>10}")

    row("Successful requests:", j["completed"])
    row("Failed requests:", j["failed"])
    if j["interrupted"]:
        row("Interrupted requests:", j["interrupted"])
    if j["max_concurrency"]:
        row("Maximum request concurrency:", j["max_concurrency"])
    if j["request_rate"] != "inf":
        row("Request rate (req/s):", float(j["request_rate"]))
    row("Benchmark duration (s):", j["duration"])
    row("Total input tokens:", j["total_input_tokens"])
    row("Total generated tokens:", j["total_output_tokens"])
    row("Request throughput (req/s):", j["request_throughput"])
    if j["request_goodput"] is not None:
        row("Request goodput (req/s):", j["request_goodput"])
    row("Output token throughput (tok/s):", j["output_throughput"])
    row("Peak output token throughput (tok/s):", j["max_output_tokens_per_s"])
    row("Peak concurrent requests:", float(j["max_concurrent_requests"]))
    row("Total Token throughput (tok/s):", j["total_token_throughput"])
    for m in METRICS:
        lines.append(METRIC_NAMES[m].center(w, "-"))
        short = m.upper()
        row(f"Mean {short} (ms):", j[f"mean_{m}_ms"])
        row(f"Median {short} (ms):", j[f"median_{m}_ms"])
        for p in args.metric_percentiles:
            row(f"P{p:g} {short} (ms):", j[f"p{p:g}_{m}_ms"])
    if (j.get("dataset_name") == "prefix-repetition" or j.get("total_cached_tokens")
            or j.get("server_prefix_cache_hits")):
        lines.append("Prefix cache".center(w, "-"))
        row("Cached prompt tokens (usage):", j.get("total_cached_tokens", 0))
        row("Prefix cache hit rate (%):", 100.0 * j.get("prefix_cache_hit_rate", 0.0))
        if j.get("server_prefix_cache_hit_rate") is not None:
            row("Server prefix cache hit rate (%):", 100.0 * j["server_prefix_cache_hit_rate"])
    if any(k.startswith("mean_server_") for k in j):
        lines.append("Server timings (reported by burst)".center(w, "-"))
        for key, name in (("queue_ms", "queue (ms)"), ("prefill_ms", "prefill (ms)"),
                          ("ttft_ms", "TTFT (ms)"), ("decode_tokens_per_s", "decode (tok/s)")):
            if f"mean_server_{key}" in j:
                row(f"Mean server {name}:", j[f"mean_server_{key}"])
                row(f"Median server {name}:", j[f"median_server_{key}"])
    if j.get("groups_summary"):
        lines.append("Per group (mixed workload)".center(w, "-"))
        for g, s in j["groups_summary"].items():
            lines.append(f"{g}: {s['completed']} ok, {s['failed']} failed; TTFT mean "
                         f"{s['mean_ttft_ms']:.1f} / median {s['median_ttft_ms']:.1f} / p99 "
                         f"{s.get('p99_ttft_ms', 0.0):.1f} ms")
    if j["error_counts"]:
        lines.append("Errors by kind".center(w, "-"))
        for kind, n in j["error_counts"].items():
            lines.append(f"{kind + ':':<40}{n:>10}")
            ex = j["error_examples"].get(kind)
            if ex:
                lines.append(f"  e.g. {ex[:w * 2]}")
    lines.append("=" * w)
    print("\n".join(lines), flush=True)


def markdown_table(results_json):
    head = ["run", "reqs", "conc", "rate", "in len", "out len", "ok", "failed", "req/s",
            "out tok/s", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "TPOT mean ms",
            "ITL p99 ms", "E2EL mean ms", "server prefill ms", "errors"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 16 + ["---"])
            + "|"]
    for j in results_json:
        lens = [j["input_lens"][i] for i in ok_rows(j)] or j["input_lens"]
        if lens and min(lens) != max(lens):
            in_len = f"{min(lens)}-{max(lens)}"
        else:
            in_len = str(lens[0]) if lens else "-"
        errs = ", ".join(f"{k} x{v}" for k, v in j.get("error_counts", {}).items()) or "-"
        prefill = j.get("mean_server_prefill_ms")

        def f(v, d=1):
            return "-" if v is None else f"{v:.{d}f}"

        rows.append("| " + " | ".join([
            j.get("label") or os.path.basename(j.get("_path", "")), str(len(j["errors"])),
            str(j.get("max_concurrency") or "-"), str(j.get("request_rate")), in_len,
            str(j.get("output_len")), str(j["completed"]), str(j["failed"]),
            f(j["request_throughput"], 2), f(j["output_throughput"]), f(j["mean_ttft_ms"]),
            f(j["median_ttft_ms"]), f(j.get("p99_ttft_ms")), f(j["mean_tpot_ms"], 2),
            f(j.get("p99_itl_ms"), 2), f(j["mean_e2el_ms"]), f(prefill), errs]) + " |")
    return "\n".join(rows) + "\n"


def report(paths, markdown, plotdir):
    results = []
    for p in paths:
        with open(p) as f:
            j = json.load(f)
        j["_path"] = p
        if not j.get("label"):
            j["label"] = os.path.splitext(os.path.basename(p))[0]
        results.append(j)
    table = markdown_table(results)
    print(table, end="")
    if markdown:
        with open(markdown, "w") as f:
            f.write(table)
    if plotdir:
        for p in plot(results, plotdir):
            log(f"burst-bench: wrote {p}")
    return 0
