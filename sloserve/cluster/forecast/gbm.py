"""A learned forecaster: gradient-boosted trees (LightGBM) on lags and calendar features, one
model per step ahead (direct strategy: no error feeding back through the horizon).

Each model predicts the change of log1p(demand) from the last value to the target step, from:
the last few values and their mean (relative to the last), the values a day and a week before
the target (when the training history holds two days, two weeks), the target's time of day (sine, cosine) and day of
the week. Trees cannot extrapolate a level they never saw; predicting the change does not need to."""
from __future__ import annotations

from typing import Optional

import numpy as np

from sloserve.cluster.forecast.base import Forecaster, require

LAGS = 6  # recent values used as features


class GBMForecaster(Forecaster):
    name = "gbm"

    def __init__(self, step_s: float, start_s: float = 0.0, level: float = 0.9, max_horizon: int = 12,
                 num_trees: int = 300, seed: int = 0) -> None:
        super().__init__(step_s, start_s, level)
        self.max_horizon = max_horizon
        self.num_trees = num_trees
        self.seed = seed
        self._models: list = []
        self._daily: Optional[bool] = None  # day-ago features (the history holds two days)
        self._weekly: Optional[bool] = None

    def _features(self, logs: np.ndarray, origin: int, h: int) -> list[float]:
        """Features for forecasting step origin + h - 1 from logs[:origin]."""
        last = logs[origin - 1]
        target = origin + h - 1
        row = [logs[origin - 1 - k] - last for k in range(1, LAGS)]
        row.append(logs[origin - LAGS:origin].mean() - last)
        if self._daily:
            day = target - self.period
            row.append(logs[day] - last if day < origin else logs[day - self.period] - last)
        if self._weekly:
            week = target - 7 * self.period
            row.append(logs[week] - last)
        sod = self.seconds_of_day(np.array([target]))[0] / 86400.0
        row += [np.sin(2 * np.pi * sod), np.cos(2 * np.pi * sod),
                float(int((self.start_s + target * self.step_s) // 86400) % 7)]
        return row

    def _first_origin(self) -> int:
        return (8 if self._weekly else 2 if self._daily else 0) * self.period + LAGS

    def fit(self, history: np.ndarray) -> None:
        try:
            import lightgbm as lgb
        except ImportError:
            raise ValueError("the gbm forecaster needs lightgbm (pip install 'sloserve[forecast]')") from None
        logs = np.log1p(history)
        self._daily = len(logs) >= 2 * self.period + self.max_horizon + 50
        self._weekly = len(logs) >= 14 * self.period
        first = self._first_origin()
        require(len(logs), first + self.max_horizon + 5, self.name)
        self._models = []
        for h in range(1, self.max_horizon + 1):
            origins = range(first, len(logs) - h + 1)
            x = np.array([self._features(logs, o, h) for o in origins])
            y = np.array([logs[o + h - 1] - logs[o - 1] for o in origins])
            params = {"objective": "regression", "learning_rate": 0.05, "num_leaves": 15, "min_data_in_leaf": 10,
                      "bagging_fraction": 0.8, "bagging_freq": 1, "seed": self.seed, "num_threads": 1, "verbose": -1}
            self._models.append(lgb.train(params, lgb.Dataset(x, y), num_boost_round=self.num_trees))

    def point(self, history: np.ndarray, horizon: int) -> np.ndarray:
        if not self._models:
            raise RuntimeError("gbm: fit() first")
        if horizon > self.max_horizon:
            raise ValueError(f"gbm was fitted for {self.max_horizon} steps ahead, not {horizon}")
        logs = np.log1p(history)
        require(len(logs), self._first_origin(), self.name)
        n = len(logs)
        x = np.array([self._features(logs, n, h) for h in range(1, horizon + 1)])
        deltas = np.array([float(self._models[h - 1].predict(x[h - 1:h])[0]) for h in range(1, horizon + 1)])
        return np.expm1(logs[-1] + deltas)
