"""SM clock policies (energy), selected by name. A new policy is one file plus one line here."""
from __future__ import annotations

from sloserve.sched.clocks.base import ClockOption, ClockPolicy, decode_run_end_by, occupancy_end_by, step_end_by
from sloserve.sched.clocks.energy_min import EnergyMinClock
from sloserve.sched.clocks.max_clock import MaxClock
from sloserve.sched.clocks.slo_slack import SLOSlackClock

CLOCK_POLICIES: dict[str, type[ClockPolicy]] = {p.name: p for p in (MaxClock, SLOSlackClock, EnergyMinClock)}


def make_clock_policy(name: str) -> ClockPolicy:
    """By name; `slo-slack:SHARE` sets the TTFT share of slo-slack."""
    base, _, arg = name.partition(":")
    try:
        cls = CLOCK_POLICIES[base]
    except KeyError:
        raise ValueError(f"unknown clock policy {name!r}; choose from {sorted(CLOCK_POLICIES)}") from None
    if not arg:
        return cls()
    if cls is not SLOSlackClock:
        raise ValueError(f"clock policy {base!r} takes no parameter (got {name!r})")
    try:
        share = float(arg)
    except ValueError:
        raise ValueError(f"slo-slack:SHARE needs a number, got {arg!r}") from None
    return SLOSlackClock(ttft_share=share)


__all__ = ["CLOCK_POLICIES", "ClockOption", "ClockPolicy", "EnergyMinClock", "MaxClock", "SLOSlackClock",
           "decode_run_end_by", "make_clock_policy", "occupancy_end_by", "step_end_by"]
