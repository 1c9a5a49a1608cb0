"""Carrying out a scale planner's plan, the same way on the real and the simulated fleet.

The controller's `plan_scaling` decides and never executes; a fleet carries its plan out through
a `ScalingPort`: the real front (front/autoscale.py: spawn and stop workers, take them out of
routing) or the simulator (sim/scaling.py: lifecycles and their cost). The order is the plan's
contract: take back draining instances first (cheapest capacity: already warm), then cancel
starts, then drain, then start stopped slots in the port's order of preference."""
from __future__ import annotations

from typing import Protocol

from sloserve.fleet_view import ScalingPlan


class ScalingPort(Protocol):
    def undrain(self, slot: int) -> None:
        """A draining instance serves again."""

    def cancel(self, slot: int) -> None:
        """A starting instance is stopped before it serves."""

    def drain(self, slot: int) -> None:
        """A ready instance leaves routing; it stops once empty."""

    def stopped(self, pool: str) -> list[int]:
        """The stopped slots of `pool`, in the order to start them."""

    def start(self, slot: int) -> None:
        """A stopped slot's instance starts (it serves after its start-up time)."""


def apply_plan(plan: ScalingPlan, port: ScalingPort, pool: str = "mixed") -> list[int]:
    """Carry `plan` out on `port` for `pool`; the slots started."""
    for slot in plan.undrain:
        port.undrain(slot)
    for slot in plan.cancel:
        port.cancel(slot)
    for slot in plan.drain:
        port.drain(slot)
    started = port.stopped(pool)[:plan.start]
    for slot in started:
        port.start(slot)
    return started
