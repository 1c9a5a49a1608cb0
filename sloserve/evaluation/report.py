"""What an evaluation run says: per decision, the candidates' wins, ties and losses in dev and in
test side by side (a split the run did not cover reads "not run"), as a rich table, as markdown
for BENCHMARKS.md (report.md), as a PNG per decision and as report.html (the tables, the figures and
every cell's numbers)."""
from __future__ import annotations

import base64
import html
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sloserve.bench.report import fmt_num
from sloserve.evaluation.decisions import make_decision
from sloserve.evaluation.runner import Evaluation
from sloserve.evaluation.suite import SPLITS
from sloserve.evaluation.verdict import OUTCOMES, Verdict

NOT_RUN = "not run"


@dataclass
class Tally:
    """One candidate's verdicts in one split."""

    outcomes: Counter = field(default_factory=Counter)
    ratios: list[float] = field(default_factory=list)

    @property
    def cells(self) -> int:
        return sum(self.outcomes.values())

    @property
    def geomean(self) -> float:
        """Geometric mean of the finite ratios (NaN when there are none)."""
        finite = [r for r in self.ratios if 0 < r < math.inf]
        return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan

    def text(self) -> str:
        text = "/".join(str(self.outcomes[o]) for o in OUTCOMES[:3])
        return text + (f" +{self.outcomes['trade']} trade" if self.outcomes["trade"] else "")


def tallies(run: Evaluation) -> dict[str, dict[str, dict[str, Tally]]]:
    """decision -> candidate -> split -> its tally (only the splits the run has cells of)."""
    out: dict[str, dict[str, dict[str, Tally]]] = {d: {} for d in run.decisions}
    for result in run.cells:
        for v in result.verdicts:
            t = out[result.cell.decision].setdefault(v.candidate, {}).setdefault(result.split, Tally())
            t.outcomes[v.outcome] += 1
            t.ratios.append(v.ratio)
    return out


def splits_run(run: Evaluation) -> set[str]:
    return {c.split for c in run.cells}


def summary_rows(run: Evaluation, decision: str) -> list[list[str]]:
    """candidate | dev W/T/L | dev geo-mean ratio | test W/T/L | test geo-mean ratio."""
    ran = splits_run(run)
    rows = []
    for candidate, per_split in tallies(run)[decision].items():
        row = [candidate]
        for split in SPLITS:
            t = per_split.get(split)
            if split not in ran:
                row += [NOT_RUN, NOT_RUN]
            elif t is None:
                row += ["0/0/0", "—"]
            else:
                row += [t.text(), fmt_num(t.geomean, 3)]
        rows.append(row)
    return rows


SUMMARY_HEADER = ["candidate", "dev win/tie/loss", "dev geo-mean ratio", "test win/tie/loss", "test geo-mean ratio"]


def decision_of(run: Evaluation, name: str):
    return make_decision(name, run.measures.get(name))


def targets(run: Evaluation, decision: str) -> list[tuple[str, list[str]]]:
    """(split, the decision's target lines on that split's cells) for each split that has any."""
    d = decision_of(run, decision)
    out = []
    for split in SPLITS:
        reached = d.targets([c for c in run.cells if c.cell.decision == decision and c.split == split])
        if reached:
            out.append((split, reached))
    return out


def cell_rows(run: Evaluation, decision: str) -> list[list[str]]:
    """Every verdict of `decision`'s cells, as the decision reads its numbers."""
    d = decision_of(run, decision)
    return [r for c in run.cells if c.cell.decision == decision for r in d.cell_rows(c)]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def esc(x: str) -> str:
        return x.replace("|", "\\|")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]


def provenance(run: Evaluation) -> str:
    dirty = " (with uncommitted changes)" if run.dirty else ""
    quick = "quick grid, " if run.quick else ""
    return (f"split {run.split}, {quick}{run.seeds} seeds, commit {run.commit[:12]}{dirty}, {run.date}, "
            f"{run.wall_s:.0f} s")


def markdown(run: Evaluation) -> str:
    """The run's tables as markdown (what BENCHMARKS.md quotes)."""
    lines = [f"### sloserve evaluate — {provenance(run)}", "",
             "Ratios are candidate ÷ baseline (> 1: the candidate is better), geometric means over the cells.", ""]
    for decision in run.decisions:
        d = decision_of(run, decision)
        lines += [f"#### {decision}", "", d.rule, "", d.describe_measure(), ""]
        lines += _md_table(SUMMARY_HEADER, summary_rows(run, decision)) + [""]
        for split, reached in targets(run, decision):
            lines += [f"Targets on the {split} split:", ""] + [f"- {t}" for t in reached] + [""]
        lines += _md_table(d.cell_header(), cell_rows(run, decision)) + [""]
    return "\n".join(lines)


def print_summary(run: Evaluation, console) -> None:
    from rich.table import Table

    for decision in run.decisions:
        metric = decision_of(run, decision).metric
        table = Table(title=f"{decision}: win/tie/loss on {metric} vs its baseline ({provenance(run)})")
        for col in SUMMARY_HEADER:
            table.add_column(col, justify="left" if col == "candidate" else "right")
        for row in summary_rows(run, decision):
            table.add_row(*row)
        console.print(table)


def figure_name(decision: str) -> str:
    return f"summary-{decision}.png"


def plot(run: Evaluation, folder: Path) -> dict[str, Path]:
    """One figure per decision, `summary-<decision>.png` (1200 x 750 px, every label 9 pt or more):
    the candidates' win/tie/loss counts per split (top), and every cell's ratio over its tie band
    (bottom: a mark per candidate, hollow in dev and filled in test, colored by the verdict; gray:
    within the noise). The decision -> path of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    all_tallies = tallies(run)
    for decision in run.decisions:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), height_ratios=(1, 1.3), layout="constrained")
        _plot_tallies(top, run, decision, all_tallies[decision])
        _plot_ratios(bottom, run, decision, list(all_tallies[decision]))
        fig.suptitle(f"{decision} — {provenance(run)}", fontsize=10)
        paths[decision] = folder / figure_name(decision)
        fig.savefig(paths[decision], dpi=100)
        plt.close(fig)
    return paths


_COLORS = {"win": "tab:green", "tie": "tab:gray", "loss": "tab:red", "trade": "tab:orange"}


def _plot_tallies(ax, run: Evaluation, decision: str, per: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    ran = splits_run(run)
    labels, lefts = [], []
    for candidate in per:
        for split in SPLITS:
            labels.append(f"{candidate} [{split}]" + ("" if split in ran else f" {NOT_RUN}"))
            lefts.append(per[candidate].get(split, Tally()))
    y = list(range(len(labels)))
    start = [0.0] * len(labels)
    for outcome in OUTCOMES:
        widths = [t.outcomes[outcome] for t in lefts]
        ax.barh(y, widths, left=start, color=_COLORS[outcome], label=outcome)
        start = [a + b for a, b in zip(start, widths)]
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("cells", fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=9)
    ax.set_title(f"verdicts on {decision_of(run, decision).metric}", fontsize=11, loc="left")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _plot_ratios(ax, run: Evaluation, decision: str, names: list[str]) -> None:
    results = [c for c in run.cells if c.cell.decision == decision]
    markers = "osD^vP*X"
    for x, result in enumerate(results):
        for v in result.verdicts:
            k = names.index(v.candidate)
            xpos = x + (k - (len(names) - 1) / 2) * 0.2
            ratio = v.ratio if math.isfinite(v.ratio) else 2.0  # only the candidate meets the SLO: drawn at 2
            ax.vlines(xpos, 1 / (1 + v.noise), 1 + v.noise, color="lightgray", linewidth=4)  # the tie band
            ax.plot([xpos], [ratio], markers[k % len(markers)], markersize=6, color=_COLORS[v.outcome],
                    markerfacecolor=_COLORS[v.outcome] if result.split == "test" else "white")
    for k, name in enumerate(names):  # the legend: which mark is which candidate
        ax.plot([], [], markers[k % len(markers)], color="black", markerfacecolor="white", label=name)
    if names:
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(-0.5, max(1, len(results)) - 0.5)
    ax.set_yscale("log")
    step = max(1, math.ceil(len(results) / 30))  # at most 30 cell labels: each stays readable
    ax.set_xticks(range(0, len(results), step), [str(i) for i in range(0, len(results), step)], fontsize=9)
    compared = next((v.metric for c in results for v in c.verdicts), decision_of(run, decision).metric)
    ax.set_ylabel(f"{compared}\n(candidate ÷ baseline, > 1 better)", fontsize=10)
    ax.set_xlabel("cell, in report.html's order\n(hollow: dev, filled: test; color: the verdict; gray: the tie band)",
                  fontsize=10)
    ax.tick_params(labelsize=9)
    ax.grid(alpha=0.3)


def html_page(run: Evaluation, figures: dict[str, Path]) -> str:
    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f'<td class="{html.escape(c) if c in OUTCOMES else ""}">{html.escape(c)}</td>'
                                        for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    parts = [f"<h1>sloserve evaluate</h1><p>{html.escape(provenance(run))}</p>"]
    for decision in run.decisions:
        d = decision_of(run, decision)
        parts.append(f"<h2>{html.escape(decision)}</h2>")
        figure = figures.get(decision)
        if figure is not None and figure.is_file():
            data = base64.b64encode(figure.read_bytes()).decode("ascii")
            parts.append(f'<img alt="{html.escape(decision)}: verdicts" src="data:image/png;base64,{data}">')
        parts.append(f"<p>{html.escape(d.rule)}</p><p>{html.escape(d.describe_measure())}</p>")
        parts.append(table(SUMMARY_HEADER, summary_rows(run, decision)))
        for split, reached in targets(run, decision):
            items = "".join(f"<li>{html.escape(t)}</li>" for t in reached)
            parts.append(f"<p>Targets on the {split} split:</p><ul>{items}</ul>")
        parts.append("<h3>cells</h3>")
        parts.append(table(d.cell_header(), cell_rows(run, decision)))
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}.win{background:#d8f5d8}.loss{background:#f8d8d8}"
             "img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>sloserve evaluate</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")


def write_report(run: Evaluation, folder: Path) -> list[Path]:
    """report.md, a summary-<decision>.png per decision and report.html in `folder`; their paths."""
    md = folder / "report.md"
    md.write_text(markdown(run))
    figures = plot(run, folder)
    page = folder / "report.html"
    page.write_text(html_page(run, figures))
    return [md, *figures.values(), page]


def verdicts_of(run: Evaluation, decision: str, split: Optional[str] = None) -> list[Verdict]:
    return [v for c in run.cells if c.cell.decision == decision and (split is None or c.split == split)
            for v in c.verdicts]
