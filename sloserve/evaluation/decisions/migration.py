"""Live migration: when a running request moves to another instance, and where.

Candidates: predicted-load routing plus a migration policy (`balance`, `balance,defrag`).
Baselines: routing alone (round-robin, least-requests, predicted-load, and prefix-affinity where
the trace shares prefixes); a candidate is judged against the best of them in each cell, so
migration earns a win only by beating the best routing without it.

`priority` is not a candidate yet: the suite's requests carry one class without targets (as the
routing and migration studies run them), so it would never move anything; it joins with a
two-class axis."""
from __future__ import annotations

from typing import Sequence

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup, Threshold
from sloserve.evaluation.fleet import Policy
from sloserve.evaluation.result import CellResult
from sloserve.evaluation.suite import Cell
from sloserve.evaluation.workloads import get_trace

ROUTER = "predicted-load"
MIGRATIONS = ("balance", "balance,defrag")
MEMORY_TIGHT = "a10-24g"  # the grid's memory-tight fleets: Llama-2-7B on A10s (Llumnix's setting)


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

    def targets(self, results: Sequence[CellResult]) -> list[str]:
        """Issue 43: goodput at 99% >= 1.15x the best routing-only policy in >= 60% of the
        memory-tight cells, and never below 0.98x in any cell."""
        out = []
        for name in (Policy(ROUTER, m).name for m in MIGRATIONS):
            verdicts = [(r, v) for r in results for v in r.verdicts if v.candidate == name]
            if not verdicts:
                continue
            tight = [v for r, v in verdicts if r.cell.params.get("hardware") == MEMORY_TIGHT]
            gained = sum(v.ratio >= 1.15 for v in tight)
            worst = min(v.ratio for _, v in verdicts)
            share = gained / len(tight) if tight else 0.0
            out.append(f"{name}: >= 1.15x the best routing-only goodput@99 in {gained} of {len(tight)} memory-tight "
                       f"cells ({100 * share:.0f}%; target >= 60%: {'met' if share >= 0.6 else 'missed'}); lowest "
                       f"ratio in any cell {worst:.3f} (target >= 0.98: {'met' if worst >= 0.98 else 'missed'})")
        return out
