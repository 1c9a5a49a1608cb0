"""PNG figures of bench results: latency CDFs, throughput–latency and SLO attainment vs rate.

Uses matplotlib's object API (`Figure` + Agg canvas) rather than pyplot, so no global backend or
figure registry is touched: safe in tests, threads and headless machines. Pure functions of
`BenchResult`s, like the markdown report, so the simulator plots its runs the same way.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from sloserve.bench.metrics import metric_values
from sloserve.bench.report import METRIC_LABELS, fmt_rate
from sloserve.bench.result import BenchResult

CDF_METRICS = ("ttft", "tpot", "itl", "e2e")


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_latency_cdfs(results: Sequence[BenchResult], path: str | Path, labels: Sequence[str] | None = None) -> Path:
    """2x2 empirical CDFs of TTFT, TPOT, ITL and E2E; one line per run (overlaid for comparisons)."""
    fig = _figure(10, 7.5)
    axes = fig.subplots(2, 2).ravel()
    for ax, metric in zip(axes, CDF_METRICS):
        for i, r in enumerate(results):
            xs = sorted(v * 1000 for v in metric_values(r.records, metric))
            if not xs:
                continue
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax.step(xs, ys, where="post", label=labels[i] if labels else r.label)
        ax.set_title(METRIC_LABELS[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside lower center", ncol=min(3, len(names)), fontsize="small")
    fig.savefig(path)
    return Path(path)


def plot_throughput_latency(results: Sequence[BenchResult], path: str | Path) -> Path:
    """Achieved output-token throughput against p50/p99 TTFT and TPOT, one point per rate."""
    fig = _figure(10, 4.2)
    axes = fig.subplots(1, 2)
    pts = sorted(results, key=lambda r: r.summary.overall.output_throughput or 0.0)
    x = [r.summary.overall.output_throughput or math.nan for r in pts]
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for q, style in ((50, "o-"), (99, "s--")):
            y = [r.summary.overall.latency[metric].p(q) * 1000 for r in pts]
            ax.plot(x, y, style, label=f"p{q}")
        for xi, r in zip(x, pts):
            ax.annotate(fmt_rate(r.rate), (xi, r.summary.overall.latency[metric].p(99) * 1000), fontsize="x-small",
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{METRIC_LABELS[metric]} (ms)")
        ax.set_title(f"{METRIC_LABELS[metric]} vs throughput (labels: offered req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path)
    return Path(path)


def plot_slo_attainment(results: Sequence[BenchResult], path: str | Path) -> Path:
    """SLO attainment (overall and per class) and goodput against the offered rate."""
    fig = _figure(10, 4.2)
    ax_att, ax_good = fig.subplots(1, 2)
    pts = sorted((r for r in results if r.rate is not None and not math.isinf(r.rate)), key=lambda r: r.rate)
    rates = [r.rate for r in pts]
    ax_att.plot(rates, [100 * (r.summary.overall.slo_attainment or 0.0) for r in pts], "o-", label="all")
    classes = sorted({c for r in pts for c in r.summary.per_class})
    if len(classes) > 1:
        for c in classes:
            ys = [100 * (r.summary.per_class[c].slo_attainment or 0.0) if c in r.summary.per_class else math.nan
                  for r in pts]
            ax_att.plot(rates, ys, ".--", label=c)
    ax_att.set_xlabel("offered rate (req/s)")
    ax_att.set_ylabel("requests meeting their SLO (%)")
    ax_att.set_ylim(0, 102)
    ax_att.set_title("SLO attainment vs rate")
    ax_att.grid(alpha=0.3)
    ax_att.legend(fontsize="small")
    ax_good.plot(rates, [r.summary.overall.goodput or 0.0 for r in pts], "o-", label="goodput")
    ax_good.plot(rates, [r.summary.overall.request_throughput or 0.0 for r in pts], "s--", label="throughput")
    ax_good.plot(rates, rates, ":", color="gray", label="offered")
    ax_good.set_xlabel("offered rate (req/s)")
    ax_good.set_ylabel("req/s")
    ax_good.set_title("goodput vs rate")
    ax_good.grid(alpha=0.3)
    ax_good.legend(fontsize="small")
    fig.savefig(path)
    return Path(path)


def write_plots(results: Sequence[BenchResult], out_dir: str | Path) -> list[Path]:
    """The standard figures of a run or a sweep, into `out_dir`."""
    out = Path(out_dir)
    paths = [plot_latency_cdfs(results, out / "latency_cdf.png")]
    if len(results) > 1:
        paths.append(plot_throughput_latency(results, out / "throughput_latency.png"))
        if any(r.summary.overall.slo_attainment is not None for r in results):
            paths.append(plot_slo_attainment(results, out / "slo_attainment.png"))
    return paths
