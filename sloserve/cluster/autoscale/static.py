"""A fixed fleet: whatever runs keeps running (the baseline the others are measured against)."""
from __future__ import annotations

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingSignals


class StaticAutoscaler(Autoscaler):
    name = "static"

    def decide(self, signals: ScalingSignals) -> ScalingDecision:
        return ScalingDecision(signals.active, "static")
