# Contract: plot(results_json, outdir) writes ttft_vs_prompt_len.png, ttft_cdf.png and
# tokens_per_s.png under outdir (one series per result, and per group of a mixed workload) and
# returns their paths; without matplotlib (imported only here, Agg backend) it logs why and
# writes nothing.
import os

from .common import log
from .metrics import ok_rows, tokens_per_second_series


def import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError as e:
        log(f"burst-bench: no plots: matplotlib is missing (Debian python3-matplotlib): {e}")
        return None


def plot(results_json, outdir):
    """TTFT vs prompt length, TTFT CDF, output tokens/s over time; one series per result
    (and per group of a mixed workload). Returns the files written."""
    plt = import_pyplot()
    if plt is None:
        return []
    os.makedirs(outdir, exist_ok=True)
    written = []

    def series(j):
        """(name, [row indices]) per group."""
        label = j.get("label") or os.path.basename(j.get("_path", "")) or "run"
        rows = ok_rows(j)
        groups = sorted({j["groups"][i] for i in rows})
        if groups in ([], ["all"]):
            return [(label, rows)]
        out = []
        for g in groups:
            idx = [i for i in rows if j["groups"][i] == g]
            lens = [j["input_lens"][i] for i in idx]
            span = f"{min(lens)}" if min(lens) == max(lens) else f"{min(lens)}-{max(lens)}"
            name = f"{g}: {span} tokens"
            out.append((name if len(results_json) == 1 else f"{label} ({name})", idx))
        return out

    def title(ax, text):
        sub = results_json[0].get("label") if len(results_json) == 1 else None
        ax.set_title(f"{text}\n{sub}" if sub else text, fontsize=10 if sub else 12)

    def save(fig, ax, heading, name):
        """Titles, grids and legends the plot, writes it as OUTDIR/name, and notes the path."""
        title(ax, heading)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    lens_all = []
    for j in results_json:
        for name, rows in series(j):
            xs = [j["input_lens"][i] for i in rows]
            lens_all += xs
            ax.scatter(xs, [j["ttfts"][i] * 1000 for i in rows], s=14, alpha=0.7, label=name)
    if lens_all and max(lens_all) > 8 * max(1, min(lens_all)):
        ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    save(fig, ax, "Time to first token vs prompt length", "ttft_vs_prompt_len.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for j in results_json:
        for name, rows in series(j):
            xs = sorted(j["ttfts"][i] * 1000 for i in rows)
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post",
                        label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    save(fig, ax, "TTFT CDF", "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for j in results_json:
        label = j.get("label") or os.path.basename(j.get("_path", "")) or "run"
        rows = ok_rows(j)
        s = tokens_per_second_series(
            [(j["start_times"][i], j["ttfts"][i], j["itls"][i], j["output_lens"][i])
             for i in rows], j["duration"])
        ax.step([t for t, _ in s], [v for _, v in s], where="post", label=label)
    ax.set_xlabel("time since the start of the run (s)")
    ax.set_ylabel("output tokens/s")
    save(fig, ax, "Output throughput over time", "tokens_per_s.png")
    return written
