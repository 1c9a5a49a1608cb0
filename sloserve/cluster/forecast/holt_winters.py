"""Holt-Winters exponential smoothing (statsmodels): a damped additive trend and a daily season.

Smoothing parameters are fitted once (`fit`); each forecast re-runs the recursions over the
history it is given with those parameters fixed, which is cheap, so the model follows the
demand as it arrives without refitting."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from sloserve.cluster.forecast.base import Forecaster, require


class HoltWintersForecaster(Forecaster):
    name = "holt-winters"

    def __init__(self, step_s: float, start_s: float = 0.0, level: float = 0.9,
                 max_history_periods: int = 7) -> None:
        super().__init__(step_s, start_s, level)
        self.max_history = max_history_periods * self.period  # the recursion forgets older data anyway
        self._params: Optional[dict] = None
        self._seasonal: Optional[str] = None

    def _model(self, y: np.ndarray, seasonal: Optional[str]):
        return _exponential_smoothing()(y, trend="add", damped_trend=True, seasonal=seasonal,
                                        seasonal_periods=self.period if seasonal else None,
                                        initialization_method="estimated")

    def fit(self, history: np.ndarray) -> None:
        y = np.log1p(history[-self.max_history:])  # multiplicative behaviour, additive model
        seasonal = "add" if len(y) >= 2 * self.period else None
        require(len(y), 10, self.name)
        model = self._model(y, seasonal)
        with warnings.catch_warnings():  # a fit that stops short of convergence is still a usable fit
            warnings.simplefilter("ignore")
            result = model.fit(optimized=True)
        p = result.params
        self._seasonal = seasonal
        self._params = {"smoothing_level": p["smoothing_level"], "smoothing_trend": p["smoothing_trend"],
                        "damping_trend": p["damping_trend"]}
        if seasonal:
            self._params["smoothing_seasonal"] = p["smoothing_seasonal"]

    def point(self, history: np.ndarray, horizon: int) -> np.ndarray:
        if self._params is None:
            raise RuntimeError("holt-winters: fit() first")
        y = np.log1p(history[-self.max_history:])
        seasonal = self._seasonal if len(y) >= 2 * self.period else None
        require(len(y), 10, self.name)
        params = self._params if seasonal else {k: v for k, v in self._params.items() if k != "smoothing_seasonal"}
        model = self._model(y, seasonal)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = model.fit(optimized=False, **params)
        return np.expm1(np.asarray(result.forecast(horizon), dtype=float))


def _exponential_smoothing():
    """statsmodels' class, imported outside any `catch_warnings` block: its import adds a warnings
    filter, which would otherwise vanish with the block and leave the next fit's warnings loud."""
    try:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing
    except ImportError:
        raise ValueError("the holt-winters forecaster needs statsmodels (pip install 'sloserve[forecast]')") from None
    return ExponentialSmoothing
