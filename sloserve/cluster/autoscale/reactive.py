"""Scaling on what is observed now, as Knative's KPA does: the instances the demand of a stable
window (60 s) needs at the target utilization; when the demand of a short panic window (6 s)
would already need twice what runs, scale up to that at once and scale nothing down while the
panic lasts (60 s). Requests queued on the ready instances count as demand to clear within a
stable window. It can only react: an instance it asks for serves one cold start later."""
from __future__ import annotations

from typing import Optional

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision, ScalingOptions, ScalingSignals


class ReactiveAutoscaler(Autoscaler):
    name = "reactive"

    def __init__(self, options: ScalingOptions) -> None:
        super().__init__(options)
        self.stable_s = float(options.extra.get("stable_window_s", 60.0))
        self.panic_s = float(options.extra.get("panic_window_s", 6.0))
        self.panic_threshold = float(options.extra.get("panic_threshold", 2.0))
        self._panic_until: Optional[float] = None
        self._panic_target = 0

    def decide(self, signals: ScalingSignals) -> ScalingDecision:
        backlog = signals.queued / self.stable_s
        stable = self.instances_for(signals.recent_rate(self.stable_s) + backlog, signals)
        panic = self.instances_for(signals.recent_rate(self.panic_s) + backlog, signals)
        if signals.active and panic >= self.panic_threshold * signals.active:
            self._panic_until = signals.now + self.stable_s
            self._panic_target = max(self._panic_target, panic)
        if self._panic_until is not None and signals.now < self._panic_until:
            target = max(stable, self._panic_target, signals.active)
            return ScalingDecision(target, f"panic: {signals.recent_rate(self.panic_s):.1f} req/s in "
                                           f"{self.panic_s:g} s needs {panic}")
        self._panic_until, self._panic_target = None, 0
        return ScalingDecision(stable, f"{signals.recent_rate(self.stable_s):.1f} req/s over {self.stable_s:g} s"
                                       + (f" + {signals.queued} queued" if signals.queued else ""))
