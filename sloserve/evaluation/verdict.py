"""Win, tie or loss of a candidate against its baseline in one cell (`Verdict`, what every
decision answers), and the goodput decisions' rule for it (`judge`), on goodput at 99%.

The baseline is the best of the candidate's baselines in the cell (highest mean goodput at 99%
over the seeds). The comparison is paired: each seed is one window of the trace, and windows
differ far more between each other (a busy hour against a quiet one: capacity 5.7 against 2.5
req/s) than two policies differ on the same window, so each seed gives its own ratio, candidate
over baseline, and the cell's ratio is their geometric mean. The noise is how much those per-seed
ratios disagree (half their spread in log terms), never under NOISE_FLOOR, which sits above one
step of the rate searches' lattice (2^(1/32), 2.2%, at `iters` 5) so that one step is never a
win. A win is a ratio above 1 + noise, a loss one below 1 / (1 + noise). A seed where neither
meets the SLO at any rate counts as a ratio of 1; one where only the candidate does, as a win
(ratio inf).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Any, Mapping, Sequence

from sloserve.evaluation.metrics import CellMetrics

NOISE_FLOOR = 0.03
# trade: better on one of a decision's two measures and worse on the other (autoscaling: cheaper but
# fewer requests within the SLO); the goodput decisions never give it
OUTCOMES = ("win", "tie", "loss", "trade")


@dataclass(frozen=True)
class Verdict:
    candidate: str
    baseline: str  # the best baseline of the cell
    candidate_value: float  # the decision's measure (`metric`), mean over the seeds
    baseline_value: float
    ratio: float  # > 1: the candidate is better (geometric mean over seeds; inf: only the candidate meets the SLO)
    noise: float  # how much the per-seed ratios disagree (>= the decision's floor)
    outcome: str  # one of OUTCOMES
    lower_bound: bool  # some value of the two is a lower bound (goodput: the window could not hold a higher rate)
    metric: str = "goodput@99 req/s"
    note: str = ""  # what else the decision says of the pair (autoscaling: attainments, x the oracle)

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["ratio"] = self.ratio if math.isfinite(self.ratio) else "inf"
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Verdict":
        kw = dict(d)
        for old, new in (("candidate_rps", "candidate_value"), ("baseline_rps", "baseline_value")):
            if old in kw:  # results.json written before verdicts named their measure
                kw[new] = kw.pop(old)
        kw["ratio"] = math.inf if kw["ratio"] == "inf" else float(kw["ratio"])
        return cls(**kw)


def seed_ratios(candidate: Sequence[CellMetrics], baseline: Sequence[CellMetrics]) -> list[float]:
    """Candidate over baseline goodput at 99%, seed by seed (1 where neither meets the SLO, inf
    where only the candidate does)."""
    by_seed = {m.seed: m.goodput99.rps for m in baseline}
    ratios = []
    for m in candidate:
        theirs = by_seed.get(m.seed)
        if theirs is None:
            raise ValueError(f"{m.policy}: seed {m.seed} has no baseline run")
        mine = m.goodput99.rps
        ratios.append(mine / theirs if theirs > 0 else (math.inf if mine > 0 else 1.0))
    return ratios


def noise_of(ratios: Sequence[float], floor: float = NOISE_FLOOR) -> float:
    """How much per-seed ratios disagree: exp(half the range of their logs) - 1, at least `floor`."""
    finite = [r for r in ratios if 0 < r < math.inf]
    if len(finite) < 2:
        return floor
    logs = [math.log(r) for r in finite]
    return max(floor, math.exp((max(logs) - min(logs)) / 2) - 1)


def judge_one(candidate: str, baselines: Sequence[str], metrics: Mapping[str, Sequence[CellMetrics]]) -> Verdict:
    if not baselines:
        raise ValueError(f"{candidate} has no baseline to be judged against")

    def mean99(name: str) -> float:
        return fmean(m.goodput99.rps for m in metrics[name])

    best = max(baselines, key=lambda b: (mean99(b), -baselines.index(b)))
    ratios = seed_ratios(metrics[candidate], metrics[best])
    ratio = paired_log_ratio(ratios)
    noise = noise_of(ratios)
    outcome = "win" if ratio > 1 + noise else "loss" if ratio < 1 / (1 + noise) else "tie"
    bounded = any(m.goodput99.limited for name in (candidate, best) for m in metrics[name])
    return Verdict(candidate, best, mean99(candidate), mean99(best), ratio, noise, outcome, bounded)


def paired_log_ratio(ratios: Sequence[float]) -> float:
    """Geometric mean of per-seed ratios (0 if any is 0, inf if any is inf)."""
    if any(r == 0 for r in ratios):
        return 0.0
    if any(math.isinf(r) for r in ratios):
        return math.inf
    return math.exp(fmean(math.log(r) for r in ratios))


def judge(metrics: Mapping[str, Sequence[CellMetrics]], judged: Mapping[str, Sequence[str]]) -> list[Verdict]:
    """One verdict per candidate (`judged`: candidate -> its baselines); `metrics`: policy -> its
    runs, one per seed."""
    for name, runs in metrics.items():
        if len(runs) < 2:
            raise ValueError(f"{name}: a verdict needs at least two seeds (the noise is how their ratios differ), "
                             f"got {len(runs)}")
    return [judge_one(c, tuple(b), metrics) for c, b in judged.items()]
