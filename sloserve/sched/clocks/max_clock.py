from __future__ import annotations

from typing import Sequence

from sloserve.sched.clocks.base import ClockOption, ClockPolicy


class MaxClock(ClockPolicy):
    """Every step at the top clock: what a busy GPU's default governor does, and the baseline."""

    name = "max"

    def choose(self, now: float, end_by: float, options: Sequence[ClockOption]) -> ClockOption:
        return options[0]
