"""Prefill/decode disaggregation: whether a fleet of N instances serves better colocated or split
into P prefill and N - P decode instances, and which split.

Every split P:(N - P) is a candidate, judged against the best colocated fleet (least-requests or
predicted-load routing). The decision a user faces is the choice itself, so the suite also judges
a choice procedure: the planner's simulation (`sloserve plan`'s search, lighter) run on windows
of the trace that no measured seed uses (the traffic a deployment is planned on, before the
traffic it then serves). It picks the layout with the highest goodput at 99% there, averaged over
its windows, trying predicted-load first, then least-requests, then the splits: a later layout
must do strictly better, so a tie keeps the colocated predicted-load fleet. "Planner's choice" is
then that layout's measurement in each seed, judged against the best of every layout of the
cell: a tie is a right choice, a loss a wrong one (it cannot win)."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Sequence

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup
from sloserve.evaluation.fleet import Policy, Setting
from sloserve.evaluation.metrics import CellMetrics, PolicyRuns, measure_cell, probe_for, start_rate
from sloserve.evaluation.result import CellResult
from sloserve.evaluation.suite import Cell, Measure

COLOCATED = (Policy("least-requests"), Policy("predicted-load"))
SPLIT_ROUTER = "least-requests"  # how a split fleet spreads prompts over its prefill instances
CHOICE = "planner's choice"
# The planner's windows and search: seeds 100 and 101 (the measured seeds are 0, 1, ...), short
# sustained rates and two bisection steps (rates 2^(1/4), 19%, apart): about 1/10 of a cell's
# measurement. Its order: the colocated routers, the stronger on dev cells first, then the splits.
PLAN_SEEDS = (100, 101)
PLAN_ORDER = (Policy("predicted-load"), Policy("least-requests"))
PLAN_MEASURE = Measure(sustain_s=10.0, sustain_ttfts=3.0, iters=2, sample=80, max_requests=5000, loads=())


def splits(instances: int) -> tuple[Policy, ...]:
    return tuple(Policy(SPLIT_ROUTER, pd=f"{p}:{instances - p}") for p in range(1, instances))


@lru_cache(maxsize=256)
def planner_choice(setting: Setting) -> Policy:
    """The layout the planner's simulation picks for `setting` (see the module docstring)."""
    layouts = (*PLAN_ORDER, *splits(setting.instances))
    total = {p: 0.0 for p in layouts}
    for seed in PLAN_SEEDS:
        probe = probe_for(setting, seed, PLAN_MEASURE)
        start = start_rate(setting, COLOCATED[0], probe)
        for policy in layouts:
            total[policy] += PolicyRuns(setting, policy, probe).goodput(0.99, start, PLAN_MEASURE.iters).rps
    best = layouts[0]
    for policy in layouts[1:]:
        if total[policy] > total[best]:
            best = policy
    return best


class DisaggregationDecision(GoodputDecision):
    name = "disaggregation"

    def policies(self, cell: Cell) -> Lineup:
        return Lineup(splits(int(cell.params["instances"])), COLOCATED)

    def judged(self, cell: Cell) -> dict[str, tuple[str, ...]]:
        lineup = self.policies(cell)
        out = super().judged(cell)
        out[CHOICE] = tuple(p.name for p in lineup.every)
        return out

    def run(self, cell: Cell, seed: int) -> dict[str, CellMetrics]:
        self.check(cell)
        setting = Setting.of(cell.params)
        lineup = self.policies(cell)
        metrics = measure_cell(setting, lineup.candidates, lineup.baselines, seed, self.measure)
        picked = planner_choice(setting).name
        metrics[CHOICE] = replace(metrics[picked], policy=f"{CHOICE}: {picked}")
        return metrics

    def cell_rows(self, result: CellResult) -> list[list[str]]:
        rows = super().cell_rows(result)
        for row, v in zip(rows, result.verdicts):
            if v.candidate == CHOICE:  # name the layout it picked
                row[2] = result.metrics[CHOICE][0].policy
        return rows

    def targets(self, results: Sequence[CellResult]) -> list[str]:
        """Issue 43: the choice right (a tie with the best layout) in >= 80% of cells."""
        verdicts = [v for r in results for v in r.verdicts if v.candidate == CHOICE]
        if not verdicts:
            return []
        right = sum(v.outcome in ("win", "tie") for v in verdicts)
        share = right / len(verdicts)
        return [f"{CHOICE}: right in {right} of {len(verdicts)} cells ({100 * share:.0f}%; target >= 80%: "
                f"{'met' if share >= 0.8 else 'missed'})"]

