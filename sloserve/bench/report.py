"""Human-readable reports of bench results: markdown tables (a run, a rate sweep, a comparison).

Everything here is a pure function of `BenchResult`s, with no HTTP and no clock, so the
simulator renders its runs with the same tables. Latencies are shown in milliseconds.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from sloserve.bench.metrics import SLO, GroupSummary, Stats
from sloserve.bench.result import BenchResult

METRIC_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "normalized_e2e": "E2E / output token"}


def fmt_ms(seconds: Optional[float]) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    return f"{seconds * 1000:.1f}"


def fmt_num(x: Optional[float], digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def fmt_pct(x: Optional[float]) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.1f} %"


def fmt_rate(rate: Optional[float]) -> str:
    if rate is None:
        return "replay"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def describe_slo(slo: Optional[SLO]) -> str:
    if slo is None or slo.empty:
        return "none"
    parts = [f"{name} ≤ {fmt_ms(v)} ms" for name, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s),
                                                        ("E2E", slo.e2e_s)) if v is not None]
    return ", ".join(parts)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def latency_table(g: GroupSummary, qs: Sequence[float]) -> list[str]:
    header = ["metric (ms)", "mean"] + [f"p{q:g}" for q in qs] + ["max", "samples"]
    rows = []
    for key, label in METRIC_LABELS.items():
        s: Stats = g.latency[key]
        rows.append([label, fmt_ms(s.mean)] + [fmt_ms(s.p(q)) for q in qs] + [fmt_ms(s.max), str(s.count)])
    return md_table(header, rows)


def run_markdown(result: BenchResult, heading_level: int = 2) -> str:
    """One run: counts, throughput, latency percentiles, SLO attainment overall and per class."""
    s = result.summary
    g = s.overall
    h = "#" * heading_level
    lines = [f"{h} {result.label}", ""]
    cfg = result.config
    if cfg:
        facts = [f"server `{cfg.get('base_url', '?')}`", f"model `{cfg.get('model') or '?'}`",
                 f"workload `{cfg.get('workload', '?')}`", f"rate {fmt_rate(result.rate)} req/s"]
        if cfg.get("max_concurrency"):
            facts.append(f"max concurrency {cfg['max_concurrency']}")
        lines += ["; ".join(facts), ""]
    errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "none"
    summary_rows = [
        ["requests sent / ok / failed", f"{g.num_requests} / {g.completed} / {g.failed}"],
        ["errors", errors],
        ["duration (s)", fmt_num(s.duration_s)],
        ["request throughput (req/s)", fmt_num(g.request_throughput, 3)],
        ["output token throughput (tok/s)", fmt_num(g.output_throughput, 1)],
        ["total token throughput (tok/s)", fmt_num(g.total_token_throughput, 1)],
        ["input / output tokens", f"{g.input_tokens} / {g.output_tokens}"],
    ]
    if result.num_unsent:
        summary_rows.insert(2, ["released but never sent (run ended)", str(result.num_unsent)])
    if g.slo_attainment is not None:
        summary_rows += [["SLO attainment", fmt_pct(g.slo_attainment)],
                         ["goodput (req/s)", fmt_num(g.goodput, 3)]]
    lines += md_table(["", "value"], summary_rows) + [""]
    lines += latency_table(g, s.percentiles) + [""]
    if len(s.per_class) > 1:
        rows = [[name, str(c.num_requests), str(c.completed), describe_slo(c.slo), fmt_pct(c.slo_attainment),
                 fmt_num(c.goodput, 3), fmt_ms(c.latency["ttft"].p(99)), fmt_ms(c.latency["tpot"].p(99))]
                for name, c in s.per_class.items()]
        lines += md_table(["class", "requests", "ok", "SLO", "attainment", "goodput (req/s)", "p99 TTFT (ms)",
                         "p99 TPOT (ms)"], rows) + [""]
    return "\n".join(lines)


def sweep_markdown(results: Sequence[BenchResult]) -> str:
    """One row per rate: what was offered, what was achieved, latency and SLO at that load."""
    rows = []
    for r in results:
        g = r.summary.overall
        lat = g.latency
        rows.append([fmt_rate(r.rate), fmt_num(g.request_throughput, 3), fmt_num(g.output_throughput, 1),
                     fmt_ms(lat["ttft"].p(50)), fmt_ms(lat["ttft"].p(99)), fmt_ms(lat["tpot"].p(50)),
                     fmt_ms(lat["tpot"].p(99)), fmt_pct(g.slo_attainment), fmt_num(g.goodput, 3), str(g.failed)])
    header = ["rate (req/s)", "achieved (req/s)", "output tok/s", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT",
              "SLO attainment", "goodput (req/s)", "failed"]
    return "\n".join(["## Rate sweep (latencies in ms)", ""] + md_table(header, rows) + [""])


def report_markdown(results: Sequence[BenchResult], title: str = "sloserve bench") -> str:
    parts = [f"# {title}", ""]
    if len(results) > 1:
        parts.append(sweep_markdown(results))
    parts += [run_markdown(r) for r in results]
    return "\n".join(parts)
