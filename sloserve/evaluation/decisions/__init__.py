"""Decisions the suite evaluates, selected by name. A new decision is one file plus one line here
(and its grid, benchmarks/suite/<name>.yaml)."""
from __future__ import annotations

from typing import Any, Optional

from sloserve.evaluation.decisions.autoscaling import AutoscalingDecision
from sloserve.evaluation.decisions.forecasting import ForecastingDecision
from sloserve.evaluation.decisions.clocks import ClocksDecision
from sloserve.evaluation.decisions.base import Decision, GoodputDecision, Lineup, Threshold
from sloserve.evaluation.decisions.disaggregation import DisaggregationDecision
from sloserve.evaluation.decisions.migration import MigrationDecision
from sloserve.evaluation.decisions.qos import QoSDecision
from sloserve.evaluation.decisions.routing import RoutingDecision
from sloserve.evaluation.decisions.tiers import TiersDecision
from sloserve.evaluation.suite import load_grid

DECISIONS: dict[str, type[Decision]] = {d.name: d for d in (
    RoutingDecision, MigrationDecision, DisaggregationDecision, AutoscalingDecision, ForecastingDecision,
    QoSDecision, TiersDecision, ClocksDecision)}


def make_decision(name: str, measure: Optional[Any] = None) -> Decision:
    """The decision `name`, measured as `measure` (an instance of its measure_type; default: the type's defaults)."""
    try:
        cls = DECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown decision {name!r}; choose from {sorted(DECISIONS)}") from None
    return cls(measure)


def measure_of(name: str, quick: bool = False) -> Any:
    """How the cells of `name`'s grid (its quick grid) are measured: the grid's measure: read by the
    decision's measure_type."""
    make_decision(name)  # an unknown name fails here, in one line
    return load_grid(name, quick).measure_as(DECISIONS[name].measure_type)


__all__ = ["Decision", "GoodputDecision", "Lineup", "Threshold", "DECISIONS", "make_decision", "measure_of", "RoutingDecision", "MigrationDecision", "AutoscalingDecision",
           "ForecastingDecision", "DisaggregationDecision", "QoSDecision",
           "TiersDecision", "ClocksDecision"]
