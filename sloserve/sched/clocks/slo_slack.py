from __future__ import annotations

from typing import Sequence

from sloserve.sched.clocks.base import OCCUPANCY_TARGET, TTFT_SHARE, ClockOption, ClockPolicy


class SLOSlackClock(ClockPolicy):
    """The least-energy clock among those that end the step in time (BEAM-style: SLO slack is
    spent on lower clocks, prefill steps against TTFT deadlines and decode steps against TBT
    deadlines); the top clock when none does. Never below the least-energy clock, since a
    slower step past it costs more energy, not less.

    `margin`: the share of the step's slack it may spend, for estimates that are not exact
    (a real engine's step-time profile); the simulator prices exactly. `ttft_share`: how much of
    a TTFT slack the step's end may use up (base.TTFT_SHARE); `slo-slack:0.3` by name.
    `occupancy_target`: how full (KV, batch slots) a stretch may leave the instance (base.OCCUPANCY_TARGET)."""

    name = "slo-slack"
    reads_deadlines = True

    def __init__(self, margin: float = 0.9, ttft_share: float = TTFT_SHARE,
                 occupancy_target: float = OCCUPANCY_TARGET):
        if not 0 < margin <= 1:
            raise ValueError(f"clock margin must be in (0, 1], got {margin}")
        if not 0 < ttft_share <= 1:
            raise ValueError(f"slo-slack's TTFT share must be in (0, 1], got {ttft_share}")
        if not 0 < occupancy_target <= 1:
            raise ValueError(f"slo-slack's occupancy target must be in (0, 1], got {occupancy_target}")
        self.margin, self.ttft_share, self.occupancy_target = margin, ttft_share, occupancy_target

    def choose(self, now: float, end_by: float, options: Sequence[ClockOption]) -> ClockOption:
        full = options[0]
        slack = end_by - now - full.seconds
        if not slack > 0:
            return full
        allowed = full.seconds + self.margin * slack
        best = full
        for option in options[1:]:
            if option.seconds <= allowed and option.joules < best.joules:
                best = option
        return best
