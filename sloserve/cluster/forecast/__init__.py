"""Demand forecasters, selected by name; a new one is one file plus one line here. Each predicts
a service's demand (requests/s, or prompt / output tokens/s) for the next steps with a band
(base.py); `evaluate.py` scores them on held-out days; the autoscaler reads them."""
from __future__ import annotations

from sloserve.cluster.forecast.base import Forecast, Forecaster, fill_gaps
from sloserve.cluster.forecast.gbm import GBMForecaster
from sloserve.cluster.forecast.holt_winters import HoltWintersForecaster
from sloserve.cluster.forecast.naive import NaiveForecaster
from sloserve.cluster.forecast.seasonal_naive import SeasonalNaiveForecaster

FORECASTERS: dict[str, type[Forecaster]] = {f.name: f for f in (
    NaiveForecaster, SeasonalNaiveForecaster, HoltWintersForecaster, GBMForecaster)}


def make_forecaster(name: str, step_s: float, start_s: float = 0.0, level: float = 0.9, **options) -> Forecaster:
    try:
        cls = FORECASTERS[name]
    except KeyError:
        raise ValueError(f"unknown forecaster {name!r}; choose from {sorted(FORECASTERS)}") from None
    return cls(step_s, start_s, level, **options)


__all__ = ["Forecast", "Forecaster", "FORECASTERS", "make_forecaster", "fill_gaps"]
