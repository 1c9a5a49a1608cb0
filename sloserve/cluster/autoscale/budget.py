"""Several services' autoscalers on one GPU budget: who gets the instances when they do not all fit.

Each service's planner says what it wants (`ScalePlanner.decide`); when the wants add up to more
than the budget, the budget is shared by marginal value: every service first gets its fewest
instances, then each remaining instance goes, one at a time, to the service whose SLO gains most
from it (`ServiceAsk.value`: requests/s expected within the SLO with n instances), never past
what that service wants. So when the budget binds, the service left short is the one whose SLO
loses least. Ties go to the service granted fewer so far, then to the one named first. Pure: time and measurements are passed in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class ServiceAsk:
    service: str
    fewest: int  # its planner's minimum: always granted
    wanted: int  # its planner's target this round
    value: Callable[[int], float]  # requests/s within its SLO with n instances (non-decreasing in n)


def share_budget(asks: Sequence[ServiceAsk], budget: int) -> dict[str, int]:
    """Instances per service, at most `budget` in all (see the module docstring)."""
    if len({a.service for a in asks}) != len(asks):
        raise ValueError("each service asks once a round")
    floor = sum(a.fewest for a in asks)
    if floor > budget:
        raise ValueError(f"the services' minimums ({floor} instances) exceed the budget of {budget}")
    granted = {a.service: a.fewest for a in asks}
    if sum(max(a.fewest, a.wanted) for a in asks) <= budget:
        return {a.service: max(a.fewest, a.wanted) for a in asks}
    left = budget - floor
    while left > 0:
        gains = [(a.value(granted[a.service] + 1) - a.value(granted[a.service]), -granted[a.service], -i, a)
                 for i, a in enumerate(asks) if granted[a.service] < a.wanted]
        if not gains:
            break
        best = max(gains, key=lambda g: g[:3])[3]
        granted[best.service] += 1
        left -= 1
    return granted


__all__ = ["ServiceAsk", "share_budget"]
