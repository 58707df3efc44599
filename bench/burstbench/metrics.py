# Contract: the numbers, as vLLM's `bench serve` computes them. percentile and describe (mean,
# median, std, pNN); tpot_of; output tokens/s over time; compute(results, duration, args,
# goodput) gives the run's aggregate fields (vLLM names: completed, failed, duration, ...,
# mean_/median_/std_/pNN_ of ttft_ms, tpot_ms, itl_ms, e2el_ms), goodput, the prefix cache
# hit rate from usage (cached_tokens over prompt tokens), burst's server timings and the
# errors by kind; group_metrics per group of a mixed workload; ok_rows picks
# the successful requests of a result JSON. Pure functions, no I/O.
import math
import statistics

from .common import SERVER_TIMINGS


def percentile(xs, p):
    """numpy.percentile's default (linear interpolation)."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def describe(xs, percentiles, scale=1000.0):
    xs = [x * scale for x in xs]
    d = {"mean": statistics.fmean(xs) if xs else 0.0,
         "median": statistics.median(xs) if xs else 0.0,
         "std": statistics.pstdev(xs) if xs else 0.0}
    for p in percentiles:
        d[f"p{p:g}"] = percentile(xs, p)
    return d


def tpot_of(r):
    return (r.e2el - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def token_times(start, ttft, itls, output_len):
    """When each content chunk arrived (seconds since the benchmark started), and the tokens
    each stands for (chunks may carry several tokens)."""
    if not ttft:
        return [], 0.0
    times = [start + ttft]
    for g in itls:
        times.append(times[-1] + g)
    return times, (output_len / len(times) if output_len else 1.0)


def tokens_per_second_series(rows, duration, bins=None):
    """[(bin start s, output tokens/s)] from per-request (start, ttft, itls, output_len)."""
    width = bins or max(0.25, duration / 40.0)
    n = max(1, int(math.ceil(duration / width)))
    counts = [0.0] * n
    for start, ttft, itls, out_len in rows:
        times, w = token_times(start, ttft, itls, out_len)
        for t in times:
            counts[min(n - 1, max(0, int(t / width)))] += w
    return [(i * width, c / width) for i, c in enumerate(counts)]


def max_tokens_per_s(rows, duration):
    """vLLM's max_output_tokens_per_s: the busiest whole second."""
    series = tokens_per_second_series(rows, max(duration, 1.0), bins=1.0)
    return max((v for _, v in series), default=0.0)


def max_concurrent(results):
    """The most requests in flight at once over the run (vLLM's max_concurrent_requests): from
    each sent request's [start, start + e2el] on the benchmark's clock; one that ends as another
    starts is not counted twice."""
    events = []
    for r in results:
        if r.sent:
            events.append((r.start, 1))
            events.append((r.start + max(r.e2el, 0.0), -1))
    peak = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        peak = max(peak, cur)
    return peak


def compute(results, duration, args, goodput):
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success and not r.interrupted]
    interrupted = [r for r in results if r.interrupted]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls]
    e2els = [r.e2el for r in ok]
    pcts = args.metric_percentiles
    out = {
        "completed": len(ok),
        "failed": len(failed),
        "interrupted": len(interrupted),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max_tokens_per_s(
            [(r.start, r.ttft, r.itls, r.output_len) for r in ok], duration),
        "max_concurrent_requests": max_concurrent(results),
    }
    # the prompt tokens the server counted (its usage.prompt_tokens, as cached_tokens is),
    # else ours; cached_tokens is 0 where the server reports none
    prompt_tokens = sum(r.server_input_len if r.server_input_len is not None else r.input_len
                        for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out["total_cached_tokens"] = cached
    out["prefix_cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else 0.0
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in describe(xs, pcts).items():
            out[f"{stat}_{name}_ms"] = v
    if goodput:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.e2el}
            if all(vals[k] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
        out["request_goodput"] = good / duration
        out["goodput_slos_ms"] = goodput
    for key in SERVER_TIMINGS:
        xs = [r.timings.get(key) for r in ok if r.timings.get(key) is not None]
        if xs:
            d = describe(xs, pcts, scale=1.0)
            for stat in ("mean", "median", "p99"):
                out[f"{stat}_server_{key}"] = d[stat]
    counts = {}
    first = {}
    for r in failed + interrupted:
        counts[r.error_kind] = counts.get(r.error_kind, 0) + 1
        first.setdefault(r.error_kind, r.error)
    out["error_counts"] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    out["error_examples"] = first
    return out


def group_metrics(results, duration, args):
    groups = sorted({r.group for r in results})
    if groups == ["all"]:
        return None
    g = {}
    for name in groups:
        rs = [r for r in results if r.group == name]
        m = compute(rs, duration, args, None)
        g[name] = {k: v for k, v in m.items()
                   if k in ("completed", "failed", "total_input_tokens", "total_output_tokens")
                   or k.endswith("_ttft_ms") or k.endswith("_tpot_ms")
                   or k.endswith("_e2el_ms") or "server_" in k}
    return g


def ok_rows(j):
    return [i for i, e in enumerate(j["errors"]) if not e]
