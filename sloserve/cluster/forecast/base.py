"""What every forecaster is: point forecasts from a model, and an uncertainty band around them
from the model's own recent errors.

The band is split-conformal: the model forecasts every origin of a calibration window it was
not fitted on, and the quantiles of its errors there (per step ahead, in log1p space, because
demand errors scale with demand) widen each later point forecast into [lo, hi]. Whatever the
model, the band then covers about `level` of what comes, as long as the future errs like the
recent past, and that is checked on held-out days (`evaluate.py`), not assumed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sloserve.workload.series import Series


@dataclass(frozen=True)
class Forecast:
    """Demand 1..h steps after the history's last value, with a band of nominal `level` coverage."""

    mean: tuple[float, ...]
    lo: tuple[float, ...]
    hi: tuple[float, ...]
    level: float
    step_s: float

    @property
    def horizon(self) -> int:
        return len(self.mean)

    def peak(self) -> float:
        """The band's top over the horizon: what capacity has to be ready for."""
        return max(self.hi)


class Forecaster(ABC):
    name: str = ""

    def __init__(self, step_s: float, start_s: float = 0.0, level: float = 0.9) -> None:
        if not 0 < level < 1:
            raise ValueError(f"band level must be in (0, 1), got {level}")
        self.step_s = step_s
        self.start_s = start_s
        self.level = level
        self.period = max(1, round(86400.0 / step_s))  # one day of steps: the seasonality every model may use
        self._err_lo: Optional[np.ndarray] = None  # per step ahead, quantiles of log1p(actual) - log1p(point)
        self._err_hi: Optional[np.ndarray] = None

    # ---- what a model implements ----------------------------------------------------------
    def fit(self, history: np.ndarray) -> None:
        """Learn from `history` (values from `start_s`); models without parameters skip it."""

    @abstractmethod
    def point(self, history: np.ndarray, horizon: int) -> np.ndarray:
        """Point forecasts for the `horizon` steps after `history` (finite, >= 0)."""

    # ---- band and use ---------------------------------------------------------------------
    def train(self, series: Series, horizon: int, calibration_steps: Optional[int] = None) -> "Forecaster":
        """Fit on all but the last `calibration_steps` of `series` (default: a day, at most a
        third of it) and calibrate the band on those."""
        values = fill_gaps(series.values)
        cal = calibration_steps if calibration_steps is not None else min(self.period, len(values) // 3)
        if cal < 1 or len(values) - cal < 2:
            raise ValueError(f"{len(values)} steps are too few to fit and calibrate on ({cal} to calibrate)")
        self.fit(values[:-cal])
        self.calibrate(values, horizon, cal)
        return self

    def calibrate(self, values: np.ndarray, horizon: int, window: int) -> None:
        errors = []
        n = len(values)
        for origin in range(n - window, n - horizon + 1):
            pred = self.point(values[:origin], horizon)
            errors.append(np.log1p(values[origin:origin + horizon]) - np.log1p(pred))
        if not errors:
            raise ValueError(f"a calibration window of {window} steps is shorter than the horizon ({horizon})")
        e = np.array(errors)
        alpha = 1 - self.level
        self._err_lo = np.quantile(e, alpha / 2, axis=0)
        self._err_hi = np.quantile(e, 1 - alpha / 2, axis=0)

    def forecast(self, history: np.ndarray, horizon: int) -> Forecast:
        """Point forecasts and the calibrated band for the `horizon` steps after `history`."""
        if self._err_lo is None or self._err_hi is None or len(self._err_lo) < horizon:
            raise RuntimeError(f"{self.name}: train() it for a horizon of at least {horizon} steps first")
        values = fill_gaps(np.asarray(history, dtype=float))
        mean = np.maximum(self.point(values, horizon), 0.0)
        base = np.log1p(mean)
        lo = np.expm1(base + np.minimum(self._err_lo[:horizon], 0.0))
        hi = np.expm1(base + np.maximum(self._err_hi[:horizon], 0.0))
        return Forecast(tuple(mean), tuple(np.maximum(lo, 0.0)), tuple(hi), self.level, self.step_s)

    # ---- helpers for models ---------------------------------------------------------------
    def seconds_of_day(self, index: np.ndarray) -> np.ndarray:
        return (self.start_s + index * self.step_s) % 86400.0


def fill_gaps(values: np.ndarray) -> np.ndarray:
    """NaNs (windows the source lacks) carried forward from the last known value (the first
    known one at the start): a gap must neither look like zero demand nor break a model."""
    v = np.array(values, dtype=float)
    bad = ~np.isfinite(v)
    if not bad.any():
        return v
    if bad.all():
        raise ValueError("the series has no known value")
    idx = np.where(~bad, np.arange(len(v)), 0)
    np.maximum.accumulate(idx, out=idx)
    first = int(np.argmax(~bad))
    idx[:first] = first
    return v[idx]


def seasonal_index(n: int, horizon: int, period: int) -> np.ndarray:
    """For the steps n .. n+horizon-1, the index of the same step a period earlier (clamped into history)."""
    idx = np.arange(n, n + horizon) - period
    while (idx >= n).any():
        idx = np.where(idx >= n, idx - period, idx)
    return idx


def require(n: int, least: int, name: str) -> None:
    if n < least:
        raise ValueError(f"{name} needs at least {least} steps of history, got {n}")


