"""From a policy's target to what the fleet does: instances to start, and which to drain.

The policy says how many instances it wants; the planner keeps the books that make that safe:
- the target is clamped to [min, max] (min 0: scale to zero);
- scaling up is immediate, and takes back a draining instance before starting a new one (it
  still holds its weights: no cold start);
- scaling down waits until the lower target held for `scale_down_delay_s` (a dip must not cost
  a cold start a minute later), cancels instances still starting first, then drains the ready
  instances with the least remaining work (their requests move off by migration, or finish).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from sloserve.cluster.autoscale.base import Autoscaler, ScalingDecision
from sloserve.fleet_view import DRAINING, READY, STARTING, STOPPED, InstanceSlot, ScalingPlan, ScalingSignals

logger = logging.getLogger(__name__)


@dataclass
class ScalePlanner:
    autoscaler: Autoscaler
    min_instances: int = 1
    max_instances: int = 1
    scale_down_delay_s: float = 300.0
    _low_since: Optional[float] = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_instances <= self.max_instances or self.max_instances < 1:
            raise ValueError(f"need 0 <= min <= max and max >= 1, got {self.min_instances}:{self.max_instances}")

    def plan(self, signals: ScalingSignals, slots: Sequence[InstanceSlot]) -> ScalingPlan:
        decision, target = self.decide(signals)
        return self.plan_to(decision, target, signals, slots)

    def decide(self, signals: ScalingSignals) -> tuple[ScalingDecision, int]:
        """The policy's decision and its target clamped to [min, max]: what this pool wants (a
        shared budget may grant less: cluster/autoscale/budget.py). Asks the policy: once a round."""
        decision = self.autoscaler.decide(signals)
        return decision, min(self.max_instances, max(self.min_instances, decision.target))

    def plan_to(self, decision: ScalingDecision, target: int, signals: ScalingSignals,
                slots: Sequence[InstanceSlot], now: bool = False) -> ScalingPlan:
        """What the fleet does to reach `target` (see the module docstring); `now`: scale down
        without the delay (a budget took the instances back)."""
        starting = [s for s in slots if s.status == STARTING]
        ready = [s for s in slots if s.status == READY]
        draining = [s for s in slots if s.status == DRAINING]
        active = len(starting) + len(ready)
        plan = ScalingPlan(decision, target)
        if target > active:
            self._low_since = None
            need = target - active
            back = tuple(s.instance_id for s in sorted(draining, key=lambda s: -s.remaining_work)[:need])
            free = sum(s.status == STOPPED for s in slots)
            plan = ScalingPlan(decision, target, start=min(need - len(back), free), undrain=back)
        elif target < active:
            if self._low_since is None:
                self._low_since = signals.now
            if now or signals.now - self._low_since >= self.scale_down_delay_s:
                excess = active - target
                cancel = tuple(s.instance_id for s in starting[:excess])
                drain = tuple(s.instance_id for s in sorted(ready, key=lambda s: s.remaining_work)
                              [:excess - len(cancel)])
                plan = ScalingPlan(decision, target, cancel=cancel, drain=drain)
                self._low_since = None
        else:
            self._low_since = None
        if plan.changes:  # the fleets keep the books of their changes; here they are logged
            logger.info("autoscale at %.0f s: %d -> %d instances (%s)", signals.now, active, target, decision.reason)
        return plan


def pool_planners(policy: str, options, bounds: dict[str, tuple[int, int]],
                  scale_down_delay_s: float) -> dict[str, ScalePlanner]:
    """A planner per pool ("mixed"; or "prefill" and "decode"), each with its own autoscaler
    (policies keep state: panic windows, a trained forecaster), between its (fewest, most)."""
    from sloserve.cluster.autoscale import make_autoscaler

    return {pool: ScalePlanner(make_autoscaler(policy, options), low, high, scale_down_delay_s)
            for pool, (low, high) in bounds.items()}
