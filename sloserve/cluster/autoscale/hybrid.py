"""Predictive, corrected by what is observed: the larger of the predictive target and the
reactive one (a burst the forecast missed, or a queue building up, still adds instances)."""
from __future__ import annotations

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingOptions, ScalingSignals
from sloserve.cluster.autoscale.predictive import PredictiveAutoscaler
from sloserve.cluster.autoscale.reactive import ReactiveAutoscaler


class HybridAutoscaler(Autoscaler):
    name = "hybrid"

    def __init__(self, options: ScalingOptions) -> None:
        super().__init__(options)
        self.predictive = PredictiveAutoscaler(options)
        self.reactive = ReactiveAutoscaler(options)

    def decide(self, signals: ScalingSignals) -> ScalingDecision:
        p, r = self.predictive.decide(signals), self.reactive.decide(signals)
        chosen = p if p.target >= r.target else r
        return ScalingDecision(chosen.target, f"{'predictive' if chosen is p else 'reactive'}: {chosen.reason}")
