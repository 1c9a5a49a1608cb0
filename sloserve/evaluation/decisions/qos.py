"""QoS scheduling: in which order an instance serves two classes of requests that share it.

Cells mix an interactive class (the cell's SLO) with a batch class whose targets are 10x (TTFT)
and 4x (TPOT) looser (evaluation/fleet.Setting.classes); goodput counts a rate only when every
class keeps its share of requests within its own targets. Candidates: the scheduling policies
`priority` (class priority, then arrival), `edf` (earliest deadline first) and `slo` (slack-aware
order with relegation and TBT-sized prefill chunks: sched/policies/slo.py). Baseline: `fcfs`. The
fleet's router is the same for all (predicted-load), so only the instance scheduler differs."""
from __future__ import annotations

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup
from sloserve.evaluation.fleet import Policy
from sloserve.evaluation.suite import Cell

ROUTER = "predicted-load"
SCHEDULERS = ("priority", "edf", "slo")


class QoSDecision(GoodputDecision):
    name = "qos"

    def policies(self, cell: Cell) -> Lineup:
        return Lineup(tuple(Policy(ROUTER, scheduler=s) for s in SCHEDULERS), (Policy(ROUTER),))
