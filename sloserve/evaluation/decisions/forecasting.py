"""Forecasting: what demand the autoscaler plans for, one cold start and more ahead.

A cell is one held-out day of a ServeGen service's request rate (`series`, `day`) forecast
`horizon_s` ahead from every 10-minute origin of that day, each forecaster trained and its band
calibrated on the days before it only (cluster/forecast/evaluate.py). A seed is the learned
models' random seed (the trees' bagging); the others answer the same in every seed.

Verdicts: each forecaster against naive ("the last value", what every forecast must beat first)
on MAPE, ratio naive ÷ candidate (> 1: more accurate), paired by seed; a tie is within how much
the seeds disagree (>= 3%). Each row also gives the max APE and the band's coverage against its
nominal level, which the issue's targets name (MAPE <= 0.8x naive's, max APE <= 60%)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from statistics import fmean
from typing import Any, Mapping, Sequence

from sloserve.evaluation.decisions.base import Decision
from sloserve.evaluation.result import CellResult, FlatRecord
from sloserve.evaluation.suite import Cell, MeasureSpec
from sloserve.evaluation.verdict import NOISE_FLOOR, Verdict, noise_of, paired_log_ratio

BASELINE = "naive"


@dataclass(frozen=True)
class ForecastMeasure(MeasureSpec):
    """How a forecasting cell is run: the forecasters judged against naive, and their band's level."""

    forecasters: tuple[str, ...] = ("seasonal-naive", "holt-winters", "gbm")
    level: float = 0.9

    def validate(self) -> None:
        from sloserve.cluster.forecast import FORECASTERS

        bad = [f for f in self.forecasters if f not in FORECASTERS or f == BASELINE]
        if bad or not self.forecasters:
            raise ValueError(f"measure: forecasters from {sorted(set(FORECASTERS) - {BASELINE})} (naive is the "
                             f"baseline), got {list(self.forecasters)}")
        if not 0 < self.level < 1:
            raise ValueError(f"measure: level in (0, 1), got {self.level}")


@dataclass(frozen=True)
class ForecastSetting:
    series: str  # a ServeGen language service: m-large, m-mid, m-small
    day: int  # the held-out day (0-based); the days before it train and calibrate
    horizon_s: float

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> "ForecastSetting":
        names = [f.name for f in fields(cls)]
        if sorted(params) != sorted(names):
            raise ValueError(f"a forecasting cell has exactly the settings {', '.join(names)}, got {sorted(params)}")
        return cls(str(params["series"]), int(params["day"]), float(params["horizon_s"]))


@dataclass(frozen=True)
class ForecastMetrics(FlatRecord):
    """One forecaster on one cell's day in one seed (evaluate.Score's numbers)."""

    policy: str
    seed: int
    mape: float
    max_ape: float
    p95_ape: float
    coverage: float
    band_width: float
    origins: int
    wall_s: float


def held_out_day(setting: ForecastSetting):
    """(the days before the cell's day, the day) of its series."""
    from sloserve.workload.series import Series, servegen_series

    series = servegen_series(setting.series)
    per_day = series.steps_per_day
    first, last = setting.day * per_day, (setting.day + 1) * per_day
    if setting.day < 2 or last > len(series):
        raise ValueError(f"servegen {setting.series}: day {setting.day} needs two days before it and must end "
                         f"within the series' {len(series) // per_day} days")
    values = series.values
    return (Series(series.name, values[:first], series.step_s, series.start_s),
            Series(series.name, values[first:last], series.step_s, series.start_s + first * series.step_s))


class ForecastingDecision(Decision):
    name = "forecasting"
    measure_type = ForecastMeasure
    metrics_type = ForecastMetrics
    metric = "MAPE (naive ÷ candidate)"
    rule = ("Verdicts on MAPE at the horizon over every origin of the held-out day, naive ÷ candidate (> 1: more "
            "accurate), paired by seed; a tie is within how much the seeds disagree (>= 3%). Each forecaster is "
            "trained and calibrated on the days before the cell's day only.")

    def run(self, cell: Cell, seed: int) -> dict[str, ForecastMetrics]:
        from sloserve.cluster.forecast import make_forecaster
        from sloserve.cluster.forecast.evaluate import evaluate

        self.check(cell)
        setting = ForecastSetting.of(cell.params)
        train, test = held_out_day(setting)
        horizon = max(1, math.ceil(setting.horizon_s / train.step_s - 1e-9))
        out = {}
        for name in (BASELINE, *self.measure.forecasters):
            t0 = time.perf_counter()
            options = {"max_horizon": horizon, "seed": seed} if name == "gbm" else {}
            forecaster = make_forecaster(name, train.step_s, train.start_s, self.measure.level, **options)
            s = evaluate(forecaster, train, test, horizon)
            out[name] = ForecastMetrics(name, seed, s.mape, s.max_ape, s.p95_ape, s.coverage, s.band_width,
                                        s.origins, time.perf_counter() - t0)
        return out

    def judge(self, cell: Cell, metrics: Mapping[str, Sequence[ForecastMetrics]]) -> list[Verdict]:
        return [judge_forecaster(name, metrics, self.measure.level) for name in self.measure.forecasters
                if name in metrics]

    def targets(self, results: Sequence[CellResult]) -> list[str]:
        """The best forecaster (highest geometric-mean MAPE ratio over the cells) against MAPE <= 0.8x
        naive's and max APE <= 60% (issue 43)."""
        if not results:
            return []
        scores = {}
        for name in self.measure.forecasters:
            ratios = [v.ratio for r in results for v in r.verdicts if v.candidate == name and 0 < v.ratio < math.inf]
            worst = max((m.max_ape for r in results for m in r.metrics.get(name, [])), default=math.nan)
            if ratios:
                scores[name] = (math.exp(fmean(math.log(x) for x in ratios)), worst)
        if not scores:
            return []
        best = max(scores, key=lambda n: scores[n][0])
        ratio, worst = scores[best]
        naive_worst = max(m.max_ape for r in results for m in r.metrics[BASELINE])
        return [f"best forecaster {best}: MAPE {1 / ratio:.3f}x naive's over {len(results)} cells (target <= 0.8x: "
                f"{'met' if 1 / ratio <= 0.8 else 'missed'}); its max APE {100 * worst:.0f}% (target <= 60%: "
                f"{'met' if worst <= 0.6 else 'missed'}; naive's {100 * naive_worst:.0f}%)"]

    def describe_measure(self) -> str:
        return (f"Forecasters {', '.join(self.measure.forecasters)} against naive; bands at "
                f"{self.measure.level:.0%} nominal coverage.")

    def cell_header(self) -> list[str]:
        return ["split", "cell", "candidate", "vs baseline", "MAPE", "ratio", "noise", "verdict", "max APE",
                "band coverage", "band width / actual"]

    def cell_rows(self, result: CellResult) -> list[list[str]]:
        rows = []
        for v in result.verdicts:
            mine, base = result.metrics[v.candidate], result.metrics[v.baseline]
            rows.append([result.split, result.cell.label, v.candidate, v.baseline,
                         f"{100 * v.candidate_value:.1f}% / {100 * v.baseline_value:.1f}%", f"{v.ratio:.3f}",
                         f"{100 * v.noise:.1f}%", v.outcome,
                         f"{100 * max(m.max_ape for m in mine):.0f}% / {100 * max(m.max_ape for m in base):.0f}%",
                         f"{100 * fmean(m.coverage for m in mine):.0f}% / {100 * fmean(m.coverage for m in base):.0f}%",
                         f"{fmean(m.band_width for m in mine):.2f} / {fmean(m.band_width for m in base):.2f}"])
        return rows


def judge_forecaster(name: str, metrics: Mapping[str, Sequence[ForecastMetrics]], level: float) -> Verdict:
    mine, base = metrics[name], metrics[BASELINE]
    if len(mine) < 2 or len(mine) != len(base):
        raise ValueError(f"{name}: a verdict needs at least two seeds, paired with naive's")
    ratios = [b.mape / m.mape if m.mape > 0 else math.inf for m, b in zip(mine, base)]
    ratio = paired_log_ratio(ratios)
    noise = noise_of(ratios, NOISE_FLOOR)
    outcome = "win" if ratio > 1 + noise else "loss" if ratio < 1 / (1 + noise) else "tie"
    note = (f"max APE {100 * max(m.max_ape for m in mine):.0f}% (naive {100 * max(b.max_ape for b in base):.0f}%), "
            f"coverage {100 * fmean(m.coverage for m in mine):.0f}% of nominal {100 * level:.0f}%")
    return Verdict(name, BASELINE, fmean(m.mape for m in mine), fmean(b.mape for b in base), ratio, noise, outcome,
                   False, metric="MAPE (naive ÷ candidate)", note=note)
