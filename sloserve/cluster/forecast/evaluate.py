"""Scoring a forecaster on held-out data: rolling origins over the held-out steps, each
forecasting `horizon` steps ahead from everything before it (what the autoscaler would have
known then), compared with what came at the horizon's last step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from sloserve.cluster.forecast.base import Forecaster
from sloserve.workload.series import Series


@dataclass(frozen=True)
class Score:
    name: str
    horizon_steps: int
    origins: int
    mape: float  # mean absolute percentage error at the horizon, over windows with known demand
    max_ape: float
    p95_ape: float
    coverage: float  # share of those windows whose demand fell inside the band
    level: float  # the band's nominal coverage
    band_width: float  # mean (hi - lo) / actual: how much capacity the band asks for beyond the truth
    actual: tuple[float, ...]  # per origin (NaN where the source has no value)
    mean: tuple[float, ...]
    lo: tuple[float, ...]
    hi: tuple[float, ...]

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "horizon_steps", "origins", "mape", "max_ape", "p95_ape",
                                              "coverage", "level", "band_width")}


def evaluate(forecaster: Forecaster, train: Series, test: Series, horizon: int,
             on_step: Optional[Callable[[int, int], None]] = None) -> Score:
    """`forecaster` trained on `train`; forecasts from every origin in `test` whose horizon ends inside it."""
    forecaster.train(train, horizon)
    history = np.concatenate([train.values, test.values])
    start = len(train)
    origins = range(start, len(history) - horizon + 1)
    actual, mean, lo, hi = [], [], [], []
    for i, origin in enumerate(origins):
        f = forecaster.forecast(history[:origin], horizon)
        actual.append(history[origin + horizon - 1])
        mean.append(f.mean[-1])
        lo.append(f.lo[-1])
        hi.append(f.hi[-1])
        if on_step is not None:
            on_step(i + 1, len(origins))
    a, m, low, high = (np.array(v) for v in (actual, mean, lo, hi))
    known = np.isfinite(a) & (a > 0)
    ape = np.abs(m[known] - a[known]) / a[known]
    inside = (a[known] >= low[known]) & (a[known] <= high[known])
    return Score(forecaster.name, horizon, len(a), float(ape.mean()), float(ape.max()), float(np.quantile(ape, 0.95)),
                 float(inside.mean()), forecaster.level, float(((high - low)[known] / a[known]).mean()),
                 tuple(a), tuple(m), tuple(low), tuple(high))
