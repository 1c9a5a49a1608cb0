"""The interface of a decision the suite evaluates, and the goodput decisions' shared half.

A decision says how its grid's `measure:` reads (`measure_type`), what one seed of a cell yields
per policy (`run`, a `metrics_type` with as_dict/from_dict, `policy`, `seed` and `wall_s`), how a
cell's seeds turn into verdicts (`judge`), and how a cell's numbers read in a report
(`cell_header`, `cell_rows`). `GoodputDecision` is all of that for decisions judged on goodput
(routing, migration): which policies a cell runs (candidates and baselines), goodput searches on
the discrete simulator, and which thresholds of a policy the tuner may search."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
import math
from typing import Any, ClassVar, Mapping, Optional, Sequence

from sloserve.bench.report import fmt_ms, fmt_num
from sloserve.evaluation.fleet import Policy, Setting
from sloserve.evaluation.metrics import CellMetrics, measure_cell
from sloserve.evaluation.result import CellResult
from sloserve.evaluation.suite import Cell, Measure
from sloserve.evaluation.verdict import Verdict, judge


class Decision(ABC):
    name: ClassVar[str]
    measure_type: ClassVar[Any] = Measure  # parses the grid's measure: (parse(raw, base), as_dict())
    metrics_type: ClassVar[Any] = CellMetrics  # one policy in one cell and seed (as_dict, from_dict)
    metric: ClassVar[str] = "goodput@99"  # what verdict ratios compare
    rule: ClassVar[str] = ""  # one paragraph: how a verdict is reached (reports print it)
    # policy name -> {constructor argument: its range}: what `sloserve evaluate --tune POLICY` searches
    thresholds: ClassVar[dict[str, dict[str, "Threshold"]]] = {}

    def __init__(self, measure: Optional[Any] = None):
        self.measure = measure if measure is not None else self.measure_type()

    @abstractmethod
    def run(self, cell: Cell, seed: int) -> dict[str, Any]:
        """Policy name -> its metrics in `cell` and `seed`."""

    @abstractmethod
    def judge(self, cell: Cell, metrics: Mapping[str, Sequence[Any]]) -> list[Verdict]:
        """One verdict per candidate; `metrics`: policy -> its runs, one per seed in seed order."""

    @abstractmethod
    def cell_header(self) -> list[str]: ...

    @abstractmethod
    def cell_rows(self, result: CellResult) -> list[list[str]]:
        """A row per verdict of `result`: split, cell, candidate, baseline, then the decision's numbers."""

    def describe_measure(self) -> str:
        """How the cells were measured, one sentence."""
        return ""

    def targets(self, results: Sequence[CellResult]) -> list[str]:
        """The issue's targets for this decision, each one line: what `results` (one split's cells)
        reach against it. None by default."""
        return []

    def check(self, cell: Cell) -> None:
        if cell.decision != self.name:
            raise ValueError(f"cell of {cell.decision!r} given to the {self.name!r} decision")


@dataclass(frozen=True)
class Lineup:
    """The policies of one cell: the candidates, and the baselines each candidate is judged against
    (the best of them in the cell, by goodput at 99%; the first one also starts every search)."""

    candidates: tuple[Policy, ...]
    baselines: tuple[Policy, ...]

    @property
    def every(self) -> tuple[Policy, ...]:
        return (*self.baselines, *self.candidates)


@dataclass(frozen=True)
class Threshold:
    """A constructor argument of a policy the tuner may search, and its range."""

    low: float
    high: float
    log: bool = False
    integer: bool = False


class GoodputDecision(Decision):
    """A decision judged on goodput at 99% against the best of its baselines (verdict.judge)."""

    rule = ("Verdicts on goodput at >= 99% of requests within the SLO (sustained arrivals), candidate ÷ the best "
            "baseline of the cell, paired by seed (each seed one window of the trace); a tie is within how much the "
            "per-seed ratios disagree (>= 3%).")

    @abstractmethod
    def policies(self, cell: Cell) -> Lineup:
        """The candidates and baselines of `cell` (they may depend on its setting)."""

    def judged(self, cell: Cell) -> dict[str, tuple[str, ...]]:
        """Candidate name -> the baselines it is judged against (the best of them in the cell)."""
        lineup = self.policies(cell)
        return {c.name: tuple(b.name for b in lineup.baselines) for c in lineup.candidates}

    def run(self, cell: Cell, seed: int) -> dict[str, CellMetrics]:
        """Every policy of `cell` measured in the seed's window (metrics.measure_cell)."""
        self.check(cell)
        lineup = self.policies(cell)
        return measure_cell(Setting.of(cell.params), lineup.candidates, lineup.baselines, seed, self.measure)

    def judge(self, cell: Cell, metrics: Mapping[str, Sequence[CellMetrics]]) -> list[Verdict]:
        return judge(metrics, self.judged(cell))

    def describe_measure(self) -> str:
        m = self.measure
        loads = ", ".join(f"{x:g}" for x in m.loads)
        return (f"Each rate held {m.sustain_s:g} s of arrivals (at least {m.sustain_ttfts:g} TTFT targets), "
                f"{m.iters} bisection steps; loads {loads} x capacity (the best baseline's goodput at 90%).")

    def cell_header(self) -> list[str]:
        return ["split", "cell", "candidate", "vs baseline", "goodput@99 req/s", "ratio", "noise", "verdict",
                "capacity req/s", "P99 TTFT ms @100%", "P99 TPOT ms @100%", "migrations (GB)"]

    def cell_rows(self, result: CellResult) -> list[list[str]]:
        rows = []
        for v in result.verdicts:
            mine, base = result.metrics[v.candidate], result.metrics[v.baseline]

            def at_full(runs, what: str) -> float:
                return _mean([getattr(p, what) for m in runs for p in m.loads if abs(p.load - 1.0) < 1e-9])

            moved = sum(m.migrations for m in mine)
            gb = sum(m.bytes_moved for m in mine) / 1e9
            rows.append([result.split, result.cell.label, v.candidate, v.baseline,
                         f"{'≥' if v.lower_bound else ''}{v.candidate_value:.2f} / {v.baseline_value:.2f}",
                         fmt_num(v.ratio, 3), f"{100 * v.noise:.1f}%", v.outcome,
                         f"{_mean([m.capacity_rps for m in mine]):.2f}",
                         f"{fmt_ms(at_full(mine, 'p99_ttft_s'))} / {fmt_ms(at_full(base, 'p99_ttft_s'))}",
                         f"{fmt_ms(at_full(mine, 'p99_tpot_s'))} / {fmt_ms(at_full(base, 'p99_tpot_s'))}",
                         f"{moved} ({gb:.2f})"])
        return rows


def _mean(values: list[float]) -> float:
    """Mean of the values that are not NaN (NaN when none is)."""
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


__all__ = ["Decision", "GoodputDecision", "Lineup", "Threshold"]
