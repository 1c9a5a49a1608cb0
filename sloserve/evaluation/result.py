"""What one cell of a run yields: its metrics per policy and seed, and its verdicts (`CellResult`);
and `FlatRecord`, the as_dict/from_dict of a decision's metrics whose fields are plain values."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from sloserve.evaluation.suite import Cell
from sloserve.evaluation.verdict import Verdict


class FlatRecord:
    """A frozen dataclass of plain values, written and read back field by field."""

    def as_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        return cls(**{f.name: d[f.name] for f in fields(cls)})  # type: ignore[arg-type]


@dataclass
class CellResult:
    """A cell's metrics (policy -> one per seed, in seed order; the decision's metrics_type) and
    its verdicts."""

    cell: Cell
    metrics: dict[str, list[Any]]
    verdicts: list[Verdict]
    wall_s: float

    @property
    def split(self) -> str:
        return self.cell.split

    def as_dict(self) -> dict:
        return {**self.cell.as_dict(), "metrics": {p: [m.as_dict() for m in runs] for p, runs in self.metrics.items()},
                "verdicts": [v.as_dict() for v in self.verdicts], "wall_s": self.wall_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], metrics_type: Any) -> "CellResult":
        """Read back; `metrics_type`: the cell's decision's (Decision.metrics_type)."""
        return cls(Cell.from_dict(d), {p: [metrics_type.from_dict(m) for m in runs] for p, runs in d["metrics"].items()},
                   [Verdict.from_dict(v) for v in d["verdicts"]], float(d["wall_s"]))
