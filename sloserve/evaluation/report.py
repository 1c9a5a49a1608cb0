"""What an evaluation run says: per decision, the candidates' wins, ties and losses in dev and in
test side by side (a split the run did not cover reads "not run"), as a rich table, as markdown
for BENCHMARKS.md (report.md), as a summary PNG and as report.html (the tables, the figure and
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
FIGURE = "summary.png"


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


def plot(run: Evaluation, path: Path) -> Path:
    """Per decision: the candidates' win/tie/loss counts per split (top), and every cell's ratio over
    its tie band (bottom, gray: within the noise; dev circles, test squares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = {"win": "tab:green", "tie": "tab:gray", "loss": "tab:red", "trade": "tab:orange"}
    ran = splits_run(run)
    n = len(run.decisions)
    fig, axes = plt.subplots(2, n, figsize=(max(9, 6 * n), 7), squeeze=False)
    all_tallies = tallies(run)
    for col, decision in enumerate(run.decisions):
        ax = axes[0][col]
        labels, lefts = [], []
        per = all_tallies[decision]
        for candidate in per:
            for split in SPLITS:
                labels.append(f"{candidate} [{split}]" + ("" if split in ran else f" {NOT_RUN}"))
                lefts.append(per[candidate].get(split, Tally()))
        y = list(range(len(labels)))
        start = [0.0] * len(labels)
        for outcome in OUTCOMES:
            widths = [t.outcomes[outcome] for t in lefts]
            ax.barh(y, widths, left=start, color=colors[outcome], label=outcome)
            start = [a + b for a, b in zip(start, widths)]
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("cells")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        metric = decision_of(run, decision).metric
        ax.set_title(f"{decision}: verdicts on {metric}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax = axes[1][col]
        results = [c for c in run.cells if c.cell.decision == decision]
        names = list(per)
        for x, result in enumerate(results):
            for v in result.verdicts:
                k = names.index(v.candidate)
                xpos = x + (k - (len(names) - 1) / 2) * 0.2
                ratio = v.ratio if math.isfinite(v.ratio) else 2.0  # only the candidate meets the SLO: drawn at 2
                ax.vlines(xpos, 1 / (1 + v.noise), 1 + v.noise, color="lightgray", linewidth=4)  # the tie band
                ax.plot([xpos], [ratio], "o" if result.split == "dev" else "s", color=colors[v.outcome], markersize=5)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.5, max(1, len(results)) - 0.5)
        ax.set_yscale("log")
        ax.set_xticks(range(len(results)), [f"{r.split}\n{i}" for i, r in enumerate(results)], fontsize=6)
        compared = next((v.metric for c in results for v in c.verdicts), metric)
        ax.set_ylabel(f"{compared}\n(candidate ÷ baseline, > 1 better)", fontsize=8)
        ax.set_xlabel("cell (report.html lists them in this order)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"sloserve evaluate: {provenance(run)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def html_page(run: Evaluation, figure: Optional[Path]) -> str:
    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f'<td class="{html.escape(c) if c in OUTCOMES else ""}">{html.escape(c)}</td>'
                                        for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    parts = [f"<h1>sloserve evaluate</h1><p>{html.escape(provenance(run))}</p>"]
    if figure is not None and figure.is_file():
        data = base64.b64encode(figure.read_bytes()).decode("ascii")
        parts.append(f'<img alt="summary" src="data:image/png;base64,{data}">')
    for decision in run.decisions:
        d = decision_of(run, decision)
        parts.append(f"<h2>{html.escape(decision)}</h2>")
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
    """report.md, summary.png and report.html in `folder`; their paths."""
    md = folder / "report.md"
    md.write_text(markdown(run))
    figure = plot(run, folder / FIGURE)
    page = folder / "report.html"
    page.write_text(html_page(run, figure))
    return [md, figure, page]


def verdicts_of(run: Evaluation, decision: str, split: Optional[str] = None) -> list[Verdict]:
    return [v for c in run.cells if c.cell.decision == decision and (split is None or c.split == split)
            for v in c.verdicts]
