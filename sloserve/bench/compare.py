"""`sloserve bench compare`: runs side by side, with ratios to the first, and one overlaid CDF.

The use case is "same client, same workload, different servers" (sloserve vs vLLM vs
llama.cpp) or "before vs after a change". Ratios are plain value/baseline; whether higher is
better depends on the row, so each row says which way is better.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from sloserve.bench.report import md_table, fmt_num
from sloserve.bench.result import BenchResult, load_results
from sloserve.bench.metrics import GroupSummary


@dataclass(frozen=True)
class Row:
    name: str
    get: Callable[[GroupSummary], Optional[float]]
    scale: float = 1.0  # 1000 for seconds shown as ms
    higher_is_better: bool = False


def _lat(metric: str, q: Optional[float]) -> Callable[[GroupSummary], Optional[float]]:
    return lambda g: g.latency[metric].mean if q is None else g.latency[metric].p(q)


ROWS = (
    Row("request throughput (req/s)", lambda g: g.request_throughput, higher_is_better=True),
    Row("output throughput (tok/s)", lambda g: g.output_throughput, higher_is_better=True),
    Row("TTFT mean (ms)", _lat("ttft", None), 1000), Row("TTFT p50 (ms)", _lat("ttft", 50), 1000),
    Row("TTFT p99 (ms)", _lat("ttft", 99), 1000),
    Row("TPOT mean (ms)", _lat("tpot", None), 1000), Row("TPOT p50 (ms)", _lat("tpot", 50), 1000),
    Row("TPOT p99 (ms)", _lat("tpot", 99), 1000),
    Row("ITL p50 (ms)", _lat("itl", 50), 1000), Row("ITL p99 (ms)", _lat("itl", 99), 1000),
    Row("E2E p50 (ms)", _lat("e2e", 50), 1000), Row("E2E p99 (ms)", _lat("e2e", 99), 1000),
    Row("SLO attainment (%)", lambda g: g.slo_attainment, 100, True),
    Row("goodput (req/s)", lambda g: g.goodput, higher_is_better=True),
    Row("failed requests", lambda g: g.failed),
)


# Rows read from a run's config rather than its summary: shown when any run has them (autoscaled
# simulations carry `scaling`: what the fleet cost to serve the run).
OUTCOME_ROWS = (
    ("instance-hours", lambda c: (c.get("scaling") or {}).get("instance_hours"), False),
    ("cold starts", lambda c: (c.get("scaling") or {}).get("cold_starts"), False),
    ("prefix hit rate", lambda c: c.get("prefix_hit_rate"), True),
    ("KV tier loads", lambda c: (c.get("tier_loads") or {}).get("loads"), True),
    ("energy (J/request)", lambda c: (c.get("energy") or {}).get("joules_per_request"), False),
    ("energy (J/output token)", lambda c: (c.get("energy") or {}).get("joules_per_output_token"), False),
)


def load_runs(paths: Sequence[str | Path]) -> tuple[list[BenchResult], list[str]]:
    """Every run of every file, with its label; `file: label` where labels would collide."""
    runs, labels, _ = load_systems(paths)
    return runs, labels


def load_systems(paths: Sequence[str | Path]) -> tuple[list[BenchResult], list[str], list[str]]:
    """`load_runs`, and which system (file) each run is of: the file's stem, or its parent folder's
    name where the stems are alike (`vllm/results.json`, `sloserve/results.json`)."""
    runs: list[BenchResult] = []
    files: list[Path] = []
    for p in paths:
        for r in load_results(p):
            runs.append(r)
            files.append(Path(p))
    stems = [f.stem for f in files]
    systems = stems if len(set(stems)) == len(set(files)) else [f.parent.name or f.stem for f in files]
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{stem}: {lab}" for stem, lab in zip(stems, labels)]
    return runs, labels, systems


# What the per-rate view compares at each offered rate.
RATE_ROWS = ("output throughput (tok/s)", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)",
             "SLO attainment (%)", "goodput (req/s)")


def per_rate_markdown(runs: Sequence[BenchResult], systems: Sequence[str]) -> str:
    """Each system against the first at the same offered rate: one table per rate that at least two
    systems ran (a sweep's ratios are only meaningful between runs offered the same load). Empty if
    no rate was run by two systems."""
    order = list(dict.fromkeys(systems))
    if len(order) < 2:
        return ""
    at: dict[float, dict[str, BenchResult]] = {}
    for run, system in zip(runs, systems):
        if run.rate is not None:
            at.setdefault(run.rate, {}).setdefault(system, run)
    rows = [r for r in ROWS if r.name in RATE_ROWS]
    parts = []
    for rate in sorted(at):
        have = [s for s in order if s in at[rate]]
        if len(have) < 2 or have[0] != order[0]:
            continue
        header = ["metric"] + [c for i, s in enumerate(have) for c in ([s] if i == 0 else [s, f"÷ {order[0]}"])]
        table = [_row_cells(row, [at[rate][s] for s in have]) for row in rows]
        title = "as fast as possible" if math.isinf(rate) else f"{rate:g} req/s"
        parts += [f"### At {title}", ""] + md_table(header, table) + [""]
    if not parts:
        return ""
    return "\n".join([f"## Per rate: each system against **{order[0]}** at the same offered rate", ""] + parts)


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base == 0:
        return "–"
    return f"{value / base:.2f}×"


def _row_cells(row: Row, runs: Sequence[BenchResult]) -> list[str]:
    """A metric's row: its name, each run's value, and after each run but the first its ratio to it."""
    values = [row.get(r.summary.overall) for r in runs]
    cells = [row.name + (" ↑" if row.higher_is_better else " ↓")]
    for i, v in enumerate(values):
        cells.append(fmt_num(v * row.scale if v is not None else None, 1 if row.scale != 1 else 3))
        if i > 0:
            cells.append(_ratio(v, values[0]))
    return cells


def compare_rows(runs: Sequence[BenchResult]) -> list[list[str]]:
    """One row per metric: the value of each run, and after each non-baseline run its ratio."""
    out = [_row_cells(row, runs) for row in ROWS]
    for name, get, higher in OUTCOME_ROWS:
        values = [get(r.outcome or {}) for r in runs]
        if all(v is None for v in values):
            continue
        cells = [name + (" ↑" if higher else " ↓")]
        for i, v in enumerate(values):
            cells.append(fmt_num(float(v) if v is not None else None, 3))
            if i > 0:
                cells.append(_ratio(v, values[0]))
        out.append(cells)
    return out


def compare_markdown(runs: Sequence[BenchResult], labels: Sequence[str]) -> str:
    header = ["metric (↑ higher / ↓ lower is better)"]
    for i, lab in enumerate(labels):
        header.append(lab)
        if i > 0:
            header.append(f"÷ {labels[0]}" if len(labels[0]) <= 24 else "ratio")
    return "\n".join(["# sloserve bench compare", "", f"Baseline: **{labels[0]}**", ""]
                     + md_table(header, compare_rows(runs)) + [""])
