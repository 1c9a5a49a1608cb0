"""SM clocks: does spending SLO slack on lower clocks save energy without costing the SLO?

Candidate: `slo-slack` (per step, the least-energy clock that still ends the step before every
decode's next TBT deadline and within its share of every waiting request's TTFT slack:
sched/clocks/slo_slack.py). Baseline: `max`, every step at the top clock. Both route by
predicted-load, both give every request the cell's SLO as its deadlines, and both book the
fleet's joules (sim/power.py: every GPU, idle time included), so only the clock differs.

A verdict weighs two measures, seed by seed: energy per request over the cell's load points
(the baseline's joules per request ÷ the candidate's: above 1 is a saving), and the SLO, read
two ways: attainment at each load point (a drop of more than ATTAINMENT_TOLERANCE at any load
is worse, the energy study's "within 1 point") and goodput at 99% (below the baseline's beyond
the seeds' noise is worse). A win saves energy and is not worse on the SLO; a trade saves energy
and is worse; a loss saves nothing and is worse; a tie neither."""
from __future__ import annotations

import math
from statistics import fmean
from typing import Mapping, Sequence

from sloserve.bench.report import fmt_num
from sloserve.evaluation.decisions.base import GoodputDecision, Lineup
from sloserve.evaluation.fleet import Policy
from sloserve.evaluation.metrics import CellMetrics
from sloserve.evaluation.result import CellResult
from sloserve.evaluation.suite import Cell
from sloserve.evaluation.verdict import NOISE_FLOOR, Verdict, noise_of, paired_log_ratio, seed_ratios

ROUTER = "predicted-load"
BASELINE = Policy(ROUTER, clock="max")
CANDIDATES = (Policy(ROUTER, clock="slo-slack"),)
ENERGY_FLOOR = 0.02  # a saving within 2% (or the seeds' disagreement, if larger) is no saving
ATTAINMENT_TOLERANCE = 0.01  # an attainment drop up to 1 point at a load point is not worse


def joules_per_request(m: CellMetrics) -> float:
    """The run's energy over its load points, per request (NaN without energy books)."""
    requests = sum(p.requests for p in m.loads)
    joules = sum(p.joules for p in m.loads)
    return joules / requests if requests and math.isfinite(joules) else math.nan


def worst_drop(mine: CellMetrics, base: CellMetrics) -> float:
    """The largest attainment drop, baseline minus candidate, over the load points both ran."""
    drops = [b.attainment - p.attainment for p in mine.loads if (b := base.at(p.load)) is not None]
    return max(drops, default=0.0)


def judge_clock(candidate: str, baseline: str, metrics: Mapping[str, Sequence[CellMetrics]]) -> Verdict:
    """`candidate` against `baseline` on energy and the SLO together (the module's rule)."""
    mine = sorted(metrics[candidate], key=lambda m: m.seed)
    base = sorted(metrics[baseline], key=lambda m: m.seed)
    if len(mine) < 2 or [m.seed for m in mine] != [b.seed for b in base]:
        raise ValueError(f"{candidate}: a verdict needs at least two seeds, paired with {baseline}'s")
    saved = [joules_per_request(b) / joules_per_request(m) for m, b in zip(mine, base)]
    if not all(math.isfinite(s) and s > 0 for s in saved):
        raise ValueError(f"{candidate} against {baseline}: a run without energy books (no clock policy?)")
    ratio = paired_log_ratio(saved)
    energy_noise = noise_of(saved, ENERGY_FLOOR)
    drop = fmean(worst_drop(m, b) for m, b in zip(mine, base))
    goodput = seed_ratios(mine, base)
    goodput_ratio = paired_log_ratio(goodput)
    better = ratio > 1 + energy_noise
    worse = drop > ATTAINMENT_TOLERANCE or goodput_ratio < 1 / (1 + noise_of(goodput, NOISE_FLOOR))
    outcome = ("trade" if better and worse else "win" if better else "loss" if worse else "tie")
    note = (f"worst attainment drop {100 * drop:.2f} points; goodput@99 {fmt_num(goodput_ratio, 3)}x "
            f"({fmean(m.goodput99.rps for m in mine):.2f} / {fmean(b.goodput99.rps for b in base):.2f} req/s)")
    bounded = any(m.goodput99.limited for m in (*mine, *base))
    return Verdict(candidate, baseline, fmean(map(joules_per_request, mine)), fmean(map(joules_per_request, base)),
                   ratio, energy_noise, outcome, bounded, metric="J/request (baseline ÷ candidate)", note=note)


class ClocksDecision(GoodputDecision):
    name = "clocks"
    metric = "J/request saved"
    rule = ("Each seed: energy per request over the load points (baseline ÷ candidate: above 1 saves), the largest "
            "attainment drop at any load point, and goodput at 99%. A win saves energy beyond the seeds' noise "
            f"(>= {100 * ENERGY_FLOOR:g}%) with no drop over {100 * ATTAINMENT_TOLERANCE:g} point and no goodput loss "
            "beyond noise; a trade saves energy and is worse on the SLO; a loss saves nothing and is worse.")

    def policies(self, cell: Cell) -> Lineup:
        return Lineup(CANDIDATES, (BASELINE,))

    def judge(self, cell: Cell, metrics: Mapping[str, Sequence[CellMetrics]]) -> list[Verdict]:
        return [judge_clock(c.name, BASELINE.name, metrics) for c in CANDIDATES]

    def cell_header(self) -> list[str]:
        return ["split", "cell", "candidate", "vs baseline", "J/request", "saved", "noise", "verdict",
                "attainment by load", "goodput@99 req/s", "capacity req/s"]

    def cell_rows(self, result: CellResult) -> list[list[str]]:
        rows = []
        for v in result.verdicts:
            mine, base = result.metrics[v.candidate], result.metrics[v.baseline]
            loads = [p.load for p in mine[0].loads]

            def att(runs: Sequence[CellMetrics], load: float) -> float:
                return 100 * fmean(p.attainment for m in runs if (p := m.at(load)) is not None)

            by_load = ", ".join(f"{x:g}: {att(mine, x):.1f}/{att(base, x):.1f}%" for x in loads)
            rows.append([result.split, result.cell.label, v.candidate, v.baseline,
                         f"{v.candidate_value:.1f} / {v.baseline_value:.1f}", fmt_num(v.ratio, 3),
                         f"{100 * v.noise:.1f}%", v.outcome, by_load,
                         f"{fmean(m.goodput99.rps for m in mine):.2f} / {fmean(m.goodput99.rps for m in base):.2f}",
                         f"{fmean(m.capacity_rps for m in mine):.2f}"])
        return rows


__all__ = ["ClocksDecision", "judge_clock", "joules_per_request", "worst_drop", "ENERGY_FLOOR",
           "ATTAINMENT_TOLERANCE"]
