"""The yardstick, not a policy to deploy: an autoscaler that knows the demand to come. At each
decision it asks for the instances the highest demand from now until one cold start and one
decision interval ahead needs at the target utilization: what a perfect forecast plans for
through the same planner, lifecycle and scale-down delay as every other policy. It needs the
run's own demand (`ScalingOptions.future`: requests/s per step from the run's start), which only
a simulated run has; `sloserve evaluate --decision autoscaling` reports every policy's
GPU-hours as a ratio to it."""
from __future__ import annotations

import math

import numpy as np

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingOptions, ScalingSignals


class OracleAutoscaler(Autoscaler):
    name = "oracle"

    def __init__(self, options: ScalingOptions) -> None:
        super().__init__(options)
        if options.future is None or not len(options.future) or not options.future_step_s:
            raise ValueError("the oracle autoscaler needs the run's demand in advance (a simulated run: "
                             "ScalingOptions.future and future_step_s)")
        self.future = np.nan_to_num(np.asarray(options.future, dtype=float), nan=0.0)
        self.step_s = float(options.future_step_s)
        self.interval_s = float(options.extra.get("interval_s", 60.0))

    def peak_ahead(self, now: float, ahead_s: float) -> float:
        """The highest demand in [now, now + ahead_s] (0 past the run's end)."""
        first = int(now // self.step_s)
        last = int(math.ceil((now + ahead_s) / self.step_s))
        window = self.future[first:max(first + 1, last)]
        return float(window.max()) if len(window) else 0.0

    def decide(self, signals: ScalingSignals) -> ScalingDecision:
        ahead = signals.cold_start_s + self.interval_s
        peak = self.peak_ahead(signals.now, ahead)
        return ScalingDecision(self.instances_for(peak, signals), f"knows {peak:.1f} req/s peaks within {ahead:g} s")
