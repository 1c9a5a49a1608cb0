"""Routing: which instance gets each request.

Candidates: predicted-load (queued prefill, predicted decode and KV overflow per instance; it also
credits a cached prefix), and prefix-affinity where the trace's requests share prefixes (the
Mooncake traces). Baselines: round-robin and least-requests; a candidate is judged against the
better of the two in each cell."""
from __future__ import annotations

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup
from sloserve.evaluation.fleet import Policy
from sloserve.evaluation.suite import Cell
from sloserve.evaluation.workloads import get_trace

BASELINES = (Policy("round-robin"), Policy("least-requests"))


class RoutingDecision(GoodputDecision):
    name = "routing"

    def policies(self, cell: Cell) -> Lineup:
        candidates = [Policy("predicted-load")]
        if get_trace(str(cell.params.get("trace"))).prefixes:
            candidates.append(Policy("prefix-affinity"))
        return Lineup(tuple(candidates), BASELINES)
