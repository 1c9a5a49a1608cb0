"""The interface of a decision the suite evaluates: which policies a cell runs (candidates and
baselines), how one seed of a cell is measured, which candidate is judged against which
baselines, and which thresholds of a policy the tuner may search."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

from sloserve.evaluation.fleet import Policy, Setting
from sloserve.evaluation.metrics import CellMetrics, measure_cell
from sloserve.evaluation.suite import Cell, Measure


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


class Decision(ABC):
    name: ClassVar[str]
    # policy name -> {constructor argument: its range}: what `sloserve evaluate --tune POLICY` searches
    thresholds: ClassVar[dict[str, dict[str, Threshold]]] = {}

    def __init__(self, measure: Optional[Measure] = None):
        self.measure = measure or Measure()

    @abstractmethod
    def policies(self, cell: Cell) -> Lineup:
        """The candidates and baselines of `cell` (they may depend on its setting)."""

    def judged(self, cell: Cell) -> dict[str, tuple[str, ...]]:
        """Candidate name -> the baselines it is judged against (the best of them in the cell)."""
        lineup = self.policies(cell)
        return {c.name: tuple(b.name for b in lineup.baselines) for c in lineup.candidates}

    def run(self, cell: Cell, seed: int) -> dict[str, CellMetrics]:
        """Every policy of `cell` measured in the seed's window (metrics.measure_cell)."""
        if cell.decision != self.name:
            raise ValueError(f"cell of {cell.decision!r} given to the {self.name!r} decision")
        lineup = self.policies(cell)
        return measure_cell(Setting.of(cell.params), lineup.candidates, lineup.baselines, seed, self.measure)
