"""Decisions the suite evaluates, selected by name. A new decision is one file plus one line here
(and its grid, benchmarks/suite/<name>.yaml)."""
from __future__ import annotations

from typing import Optional

from sloserve.evaluation.decisions.base import Decision, Lineup, Threshold
from sloserve.evaluation.decisions.migration import MigrationDecision
from sloserve.evaluation.decisions.routing import RoutingDecision
from sloserve.evaluation.suite import Measure

DECISIONS: dict[str, type[Decision]] = {d.name: d for d in (RoutingDecision, MigrationDecision)}


def make_decision(name: str, measure: Optional[Measure] = None) -> Decision:
    try:
        cls = DECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown decision {name!r}; choose from {sorted(DECISIONS)}") from None
    return cls(measure)


__all__ = ["Decision", "Lineup", "Threshold", "DECISIONS", "make_decision", "RoutingDecision", "MigrationDecision"]
