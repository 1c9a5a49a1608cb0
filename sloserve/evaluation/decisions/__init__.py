"""Decisions the suite evaluates, selected by name. A new decision is one file plus one line here
(and its grid, benchmarks/suite/<name>.yaml)."""
from __future__ import annotations

from typing import Any, Optional

from sloserve.evaluation.decisions.autoscaling import AutoscalingDecision
from sloserve.evaluation.decisions.forecasting import ForecastingDecision
from sloserve.evaluation.decisions.base import Decision, GoodputDecision, Lineup, Threshold
from sloserve.evaluation.decisions.migration import MigrationDecision
from sloserve.evaluation.decisions.routing import RoutingDecision

DECISIONS: dict[str, type[Decision]] = {d.name: d for d in (
    RoutingDecision, MigrationDecision, AutoscalingDecision, ForecastingDecision)}


def make_decision(name: str, measure: Optional[Any] = None) -> Decision:
    """The decision `name`, measured as `measure` (an instance of its measure_type; default: the type's defaults)."""
    try:
        cls = DECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown decision {name!r}; choose from {sorted(DECISIONS)}") from None
    return cls(measure)


__all__ = ["Decision", "GoodputDecision", "Lineup", "Threshold", "DECISIONS", "make_decision", "RoutingDecision", "MigrationDecision", "AutoscalingDecision",
           "ForecastingDecision"]
