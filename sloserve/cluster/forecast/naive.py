"""The baseline every other forecaster must beat: demand stays where it is."""
from __future__ import annotations

import numpy as np

from sloserve.cluster.forecast.base import Forecaster, require


class NaiveForecaster(Forecaster):
    name = "naive"

    def point(self, history: np.ndarray, horizon: int) -> np.ndarray:
        require(len(history), 1, self.name)
        return np.full(horizon, float(history[-1]))
