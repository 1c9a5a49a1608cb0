from __future__ import annotations

from typing import Sequence

from sloserve.sched.clocks.base import ClockOption, ClockPolicy


class EnergyMinClock(ClockPolicy):
    """Every step at its least-energy clock, whatever the deadlines: the most a clock policy
    can save, and what ignoring the SLOs costs in attainment."""

    name = "energy-min"

    def choose(self, now: float, end_by: float, options: Sequence[ClockOption]) -> ClockOption:
        return min(options, key=lambda o: o.joules)
