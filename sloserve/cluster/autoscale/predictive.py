"""Scaling ahead of demand (PreServe's idea): forecast the demand from one cold start from now
until one decision interval after that, and have the instances for the top of the forecast's
band ready by then, since an instance asked for now serves only after its cold start. Never
fewer than what the demand observed now needs, so a forecast that undershoots does not take
away capacity already in use."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingOptions, ScalingSignals
from sloserve.cluster.forecast import Forecaster, make_forecaster
from sloserve.workload.series import Series


class PredictiveAutoscaler(Autoscaler):
    name = "predictive"

    def __init__(self, options: ScalingOptions) -> None:
        super().__init__(options)
        self._forecaster: Optional[Forecaster] = None
        self._trained_for = 0  # horizon (steps) the band was calibrated for
        self.interval_s = float(options.extra.get("interval_s", 60.0))

    def _history(self, signals: ScalingSignals, step: float) -> np.ndarray:
        """The demand before the run and during it, in the forecaster's steps (observed windows
        averaged into whole forecaster steps; a step still under way is left out)."""
        past = self.options.history if self.options.history is not None else np.zeros(0)
        seen = np.asarray(signals.demand, dtype=float)
        k = max(1, round(step / signals.step_s))
        whole = len(seen) // k * k
        return np.concatenate([past, seen[:whole].reshape(-1, k).mean(axis=1) if whole else np.zeros(0)])

    def forecast_peak(self, signals: ScalingSignals) -> tuple[float, float]:
        """(the band's top over the steps that matter, how far ahead that looked, in seconds)."""
        step = self.options.history_step_s or signals.step_s
        lead = signals.cold_start_s + self.interval_s
        horizon = max(1, math.ceil(lead / step - 1e-9))
        if self._forecaster is None or self._trained_for < horizon:
            if self.options.history is None or len(self.options.history) < 3:
                raise ValueError(f"the {self.name} autoscaler needs demand history to train its forecaster")
            self._forecaster = make_forecaster(self.options.forecaster, step, self.options.history_start_s,
                                               self.options.level)
            self._forecaster.train(Series("history", self.options.history, step, self.options.history_start_s),
                                   horizon)
            self._trained_for = horizon
        first = min(horizon - 1, max(0, math.floor(signals.cold_start_s / step) - 1))
        f = self._forecaster.forecast(self._history(signals, step), horizon)
        return max(f.hi[first:]), horizon * step

    def decide(self, signals: ScalingSignals) -> ScalingDecision:
        peak, ahead_s = self.forecast_peak(signals)
        now_rate = signals.recent_rate(60.0)
        target = max(self.instances_for(peak, signals), self.instances_for(now_rate, signals))
        return ScalingDecision(target, f"forecast up to {peak:.1f} req/s within {ahead_s:g} s (now {now_rate:.1f})")
