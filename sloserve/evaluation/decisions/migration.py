"""Live migration: when a running request moves to another instance, and where.

Candidates: predicted-load routing plus a migration policy (`balance`, `balance,defrag`).
Baselines: routing alone (round-robin, least-requests, predicted-load, and prefix-affinity where
the trace shares prefixes); a candidate is judged against the best of them in each cell, so
migration earns a win only by beating the best routing without it.

`priority` is not a candidate yet: the suite's requests carry one class without targets (as the
routing and migration studies run them), so it would never move anything; it joins with a
two-class axis."""
from __future__ import annotations

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup, Threshold
from sloserve.evaluation.fleet import Policy
from sloserve.evaluation.suite import Cell
from sloserve.evaluation.workloads import get_trace

ROUTER = "predicted-load"
MIGRATIONS = ("balance", "balance,defrag")


class MigrationDecision(GoodputDecision):
    name = "migration"
    # constructor arguments of sloserve/cluster/migration/{balance,defrag}.py (tests check they are)
    thresholds = {
        "balance": {"min_gap": Threshold(256.0, 16384.0, log=True), "rel_gap": Threshold(0.1, 1.0),
                    "min_gain": Threshold(32.0, 2048.0, log=True), "kv_reserve": Threshold(0.0, 0.2)},
        "defrag": {"max_moves_per_instance": Threshold(1, 8, integer=True)},
    }

    def policies(self, cell: Cell) -> Lineup:
        routers = ["round-robin", "least-requests", ROUTER]
        if get_trace(str(cell.params.get("trace"))).prefixes:
            routers.append("prefix-affinity")
        return Lineup(tuple(Policy(ROUTER, m) for m in MIGRATIONS), tuple(Policy(r) for r in routers))
