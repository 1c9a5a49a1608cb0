"""Demand repeats the day: the value at the same time a day ago (a week ago once there are
two weeks of history, when `weekly`), scaled by how the last hour compares with the same hour
then. Without a full season of history it falls back to the last value."""
from __future__ import annotations

import numpy as np

from sloserve.cluster.forecast.base import Forecaster, require, seasonal_index


class SeasonalNaiveForecaster(Forecaster):
    name = "seasonal-naive"

    def __init__(self, step_s: float, start_s: float = 0.0, level: float = 0.9, weekly: bool = False,
                 level_window_s: float = 3600.0) -> None:
        super().__init__(step_s, start_s, level)
        self.weekly = weekly
        self.level_window = max(1, round(level_window_s / step_s))

    def point(self, history: np.ndarray, horizon: int) -> np.ndarray:
        n = len(history)
        require(n, 1, self.name)
        season = 7 * self.period if self.weekly and n >= 14 * self.period else self.period
        if n < season + self.level_window:
            return np.full(horizon, float(history[-1]))
        w = self.level_window
        recent, then = history[n - w:].mean(), history[n - w - season:n - season].mean()
        ratio = recent / then if then > 0 else 1.0
        return history[seasonal_index(n, horizon, season)] * ratio
