"""Output of ``epd bench``: the summary table, the JSON files (per-request records, summary) and
PNG plots (TTFT / TPOT CDFs, latency over time, SLO attainment vs rate), drawn with matplotlib (a
dependency of the package, so the README's setup draws them)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from epd.bench.metrics import PERCENTILES, percentile_key

# --percentile-metrics names (vLLM's) -> (summary key, table title)
LATENCIES = {"ttft": ("ttft_ms", "Time to First Token"), "tpot": ("tpot_ms", "Time per Output Token (excl. 1st)"),
             "itl": ("itl_ms", "Inter-token Latency"), "e2el": ("e2e_ms", "End-to-end Latency")}


@dataclass(frozen=True)
class ReportChoice:
    """Which latencies the table shows percentiles of, and which percentiles."""

    metrics: tuple[str, ...] = tuple(LATENCIES)
    percentiles: tuple[float, ...] = PERCENTILES


def report_choice(metrics: str, percentiles: str) -> ReportChoice:
    """``--percentile-metrics`` and ``--metric-percentiles`` -> a ReportChoice (ValueError naming
    what is wrong)."""
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    unknown = [m for m in names if m not in LATENCIES]
    if not names or unknown:
        raise ValueError(f"--percentile-metrics: expected a comma list of {list(LATENCIES)}, got {metrics!r}")
    try:
        qs = [float(q) for q in percentiles.split(",") if q.strip()]
    except ValueError:
        qs = []
    if not qs or not all(0 < q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles: expected a comma list of numbers in (0, 100], got {percentiles!r}")
    return ReportChoice(tuple(dict.fromkeys(names)), tuple(sorted(set(qs))))


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(run: dict, choice: ReportChoice = ReportChoice()) -> str:
    """One run (``{"rate", "client", "server"}``) as a fixed-width text table; ``choice``: the
    latencies and percentiles to show."""
    c, s = run["client"], run.get("server") or {}
    w = 44
    lines = []

    def row(label: str, value, digits: int = 2) -> None:
        lines.append(f"{label:<{w}}{_fmt(value, digits):>14}")

    def rule(title: str = "") -> None:
        lines.append(f"{title:-^{w + 14}}" if title else "=" * (w + 14))

    rule(f" epd bench: request rate {_fmt(run['rate'], 3)} req/s ")
    row("Backend", run.get("backend"))
    row("Successful requests", c["completed"])
    row("Failed requests", c["failed"])
    if c["cancelled"] or c["not_sent"]:
        row("Cancelled at deadline / not sent", f"{c['cancelled']} / {c['not_sent']}")
    row("Duration (s)", c["duration_s"])
    row("Request throughput (req/s)", c["request_throughput"])
    row("Output token throughput (tok/s)", c["output_throughput"])
    row("Total output tokens", c["total_output_tokens"])
    row("Images sent (repeats)", f"{c['images_sent']} ({c['repeated_images_sent']})")
    if c.get("goodput") is not None:
        slo = " & ".join(x for x in (
            f"TTFT<={_fmt(c['slo_ttft_ms'], 0)}ms" if c["slo_ttft_ms"] is not None else "",
            f"TPOT<={_fmt(c['slo_tpot_ms'], 0)}ms" if c["slo_tpot_ms"] is not None else "") if x)
        row(f"Goodput (req/s, {slo})", c["goodput"])
        row("SLO attainment (%)", c["slo_attainment_pct"], 1)
    for name in choice.metrics:
        key, title = LATENCIES[name]
        d = c[key]
        rule(f" {title} ")
        row("Mean (ms)", d["mean"])
        for q in choice.percentiles:
            row(f"P{q:g} (ms)", d.get(percentile_key(q)))
    if s.get("available"):
        rule(" Server (/metrics, after - before) ")
        rate = s.get("encoder_cache_hit_rate")
        src = s.get("encoder_cache_hit_rate_source")
        row(f"Encoder cache hit rate (%{', ' + src if src else ''})", None if rate is None else 100 * rate, 1)
        row("Encoder items encoded", s.get("encoder_encoded_items"), 0)
        row("Encoder batches", s.get("encoder_forwards"), 0)
        pc = s.get("prefix_cache_hit_rate")
        row("Prefix cache hit tokens (%)", None if pc is None else 100 * pc, 1)
        row("Server TTFT mean (ms)", s.get("server_ttft_mean_ms"))
        for reason, n in (s.get("admission_rejections") or {}).items():
            if n:
                row(f"Admission rejections: {reason}", n, 0)
        for name, q in (s.get("queues") or {}).items():
            row(f"{name}: before/after, mean/max",
                f"{_fmt(q['before'], 0)}/{_fmt(q['after'], 0)}, {_fmt(q['mean'], 1)}/{_fmt(q['max'], 0)}")
    elif run.get("server") is not None:
        rule(" Server ")
        row("/metrics", "not scraped")
    if c.get("errors"):
        rule(" Errors ")
        for msg, n in c["errors"].items():
            lines.append(f"{n:>5} x {msg}")
    rule()
    return "\n".join(lines)


def format_sweep(runs: Sequence[dict]) -> str:
    """A rate sweep as one line per rate."""
    head = (f"{'rate':>8} {'ok':>6} {'fail':>5} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8} {'SLO %':>6}")
    lines = [head, "-" * len(head)]
    for run in runs:
        c = run["client"]
        lines.append(f"{_fmt(run['rate'], 2):>8} {c['completed']:>6} {c['failed']:>5} "
                     f"{_fmt(c['request_throughput']):>8} {_fmt(c['output_throughput'], 1):>9} "
                     f"{_fmt(c['ttft_ms']['p50'], 1):>9} {_fmt(c['ttft_ms']['p99'], 1):>9} "
                     f"{_fmt(c['tpot_ms']['p50'], 1):>9} {_fmt(c['tpot_ms']['p99'], 1):>9} "
                     f"{_fmt(c.get('goodput')):>8} {_fmt(c.get('slo_attainment_pct'), 1):>6}")
    return "\n".join(lines)


def _jsonable(value):
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(out_dir: Path, config: dict, runs: Sequence[dict], records: Sequence) -> list[Path]:
    """``records.jsonl`` (one line per request, every run, with its rate) and ``summary.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rec_path, sum_path = out_dir / "records.jsonl", out_dir / "summary.json"
    with rec_path.open("w") as f:
        for r in records:
            f.write(json.dumps(_jsonable(r.to_json())) + "\n")
    sum_path.write_text(json.dumps(_jsonable({"config": config, "runs": list(runs)}), indent=2) + "\n")
    return [rec_path, sum_path]


def write_plots(out_dir: Path, runs: Sequence[dict], records_by_run: Sequence[Sequence]) -> list[Path]:
    """PNG plots; returns the files written ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    labels = [f"rate {_fmt(run['rate'], 2)}" for run in runs]

    def cdf(values_ms, ax, label):
        data = sorted(values_ms)
        if data:
            ys = [(i + 1) / len(data) for i in range(len(data))]
            ax.step(data, ys, where="post", label=label)

    slo_of = {"ttft": runs[0]["client"].get("slo_ttft_ms"), "tpot": runs[0]["client"].get("slo_tpot_ms")}
    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token (after the first)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for records, label in zip(records_by_run, labels):
            if metric == "ttft":
                values = [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None]
            else:
                values = [r.tpot_s * 1000 for r in records if r.ok and r.output_tokens > 1]
            cdf(values, ax, label)
        if slo_of[metric] is not None:
            ax.axvline(slo_of[metric], color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title}: CDF")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        path = out_dir / f"{metric}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for records, label in zip(records_by_run, labels):
        ok = [r for r in records if r.ok and r.start_s is not None]
        axes[0].scatter([r.start_s for r in ok], [r.ttft_s * 1000 for r in ok], s=8, label=label)
        axes[1].scatter([r.start_s for r in ok], [r.e2e_s * 1000 for r in ok], s=8, label=label)
        bad = [r for r in records if not r.ok and r.start_s is not None]
        if bad:
            axes[1].scatter([r.start_s for r in bad], [0] * len(bad), marker="x", color="red", s=16)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("end-to-end (ms)")
    axes[1].set_xlabel("request start (s after the run began; x = failed / cancelled)")
    axes[0].set_title("Latency over time")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path = out_dir / "latency_over_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    if len(runs) > 1:
        finite = [run for run in runs if not math.isinf(run["rate"])]
        if finite:
            xs = [run["rate"] for run in finite]
            fig, ax = plt.subplots(figsize=(7, 4.5))
            if finite[0]["client"].get("slo_attainment_pct") is not None:
                ax.plot(xs, [run["client"]["slo_attainment_pct"] for run in finite], "o-", label="SLO attainment %")
                ax.set_ylabel("SLO attainment (%)")
                ax.set_ylim(0, 105)
            else:  # no SLO given: completed share
                ax.plot(xs, [100.0 * run["client"]["completed"] / max(run["client"]["num_requests"], 1)
                             for run in finite], "o-", label="completed %")
                ax.set_ylabel("completed (%)")
                ax.set_ylim(0, 105)
            ax2 = ax.twinx()
            ax2.plot(xs, [run["client"]["request_throughput"] for run in finite], "s--", color="gray",
                     label="throughput (req/s)")
            if finite[0]["client"].get("goodput") is not None:
                ax2.plot(xs, [run["client"]["goodput"] for run in finite], "^--", color="green",
                         label="goodput (req/s)")
            ax2.set_ylabel("req/s")
            ax2.set_ylim(bottom=0)
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_title("SLO attainment vs request rate")
            ax.grid(alpha=0.3)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="best", fontsize="small")
            fig.tight_layout()
            path = out_dir / "slo_attainment_vs_rate.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written
