"""Several services' autoscalers on one GPU budget: who gets the instances when they do not all fit.

Each service's planner says what it wants (`ScalePlanner.decide`). When the wants fit the budget,
each gets what it wants. When they do not, moving an instance between services costs a start
(and the giver's drain), so the round starts from what each holds:
1. each keeps what it holds, up to what it wants (never below its fewest);
2. the spare instances go one at a time to the service whose SLO gains most from one more
   (`ServiceAsk.value`: requests/s expected within the SLO with n instances), up to its want;
3. an instance moves from one service to another only while the taker gains more than
   `SWITCH_MARGIN` times what the giver loses, so the allocation does not churn on noise.
The service left short when the budget binds is the one whose SLO loses least. Ties go to the
service granted fewer so far, then to the one named first. Pure: measurements are passed in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

SWITCH_MARGIN = 2.0


@dataclass(frozen=True)
class ServiceAsk:
    service: str
    fewest: int  # its planner's minimum: always granted
    wanted: int  # its planner's target this round
    value: Callable[[int], float]  # requests/s within its SLO with n instances (non-decreasing in n)
    held: int = 0  # instances it runs now (ready and starting)


def share_budget(asks: Sequence[ServiceAsk], budget: int) -> dict[str, int]:
    """Instances per service, at most `budget` in all (see the module docstring)."""
    if len({a.service for a in asks}) != len(asks):
        raise ValueError("each service asks once a round")
    floor = sum(a.fewest for a in asks)
    if floor > budget:
        raise ValueError(f"the services' minimums ({floor} instances) exceed the budget of {budget}")
    if sum(max(a.fewest, a.wanted) for a in asks) <= budget:
        return {a.service: max(a.fewest, a.wanted) for a in asks}
    granted = {a.service: max(a.fewest, min(a.wanted, a.held)) for a in asks}
    while sum(granted.values()) > budget:  # held more than the budget now allows: the least valuable go
        giver = min((a for a in asks if granted[a.service] > a.fewest), key=lambda a: _loss(a, granted))
        granted[giver.service] -= 1

    def gains(exclude: str = "") -> list[tuple[float, int, int, ServiceAsk]]:
        return [(_gain(a, granted), -granted[a.service], -i, a) for i, a in enumerate(asks)
                if granted[a.service] < a.wanted and a.service != exclude]

    left = budget - sum(granted.values())
    while left > 0 and gains():
        best = max(gains(), key=lambda g: g[:3])[3]
        granted[best.service] += 1
        left -= 1
    for _ in range(budget):  # moves between services, each a clear gain
        takers = gains()
        if not takers:
            break
        gain, _, _, taker = max(takers, key=lambda g: g[:3])
        givers = [a for a in asks if a.service != taker.service and granted[a.service] > a.fewest]
        if not givers:
            break
        giver = min(givers, key=lambda a: _loss(a, granted))
        if gain <= SWITCH_MARGIN * _loss(giver, granted):
            break
        granted[giver.service] -= 1
        granted[taker.service] += 1
    return granted


def _gain(a: ServiceAsk, granted: dict[str, int]) -> float:
    n = granted[a.service]
    return a.value(n + 1) - a.value(n)


def _loss(a: ServiceAsk, granted: dict[str, int]) -> float:
    n = granted[a.service]
    return a.value(n) - a.value(n - 1)


__all__ = ["SWITCH_MARGIN", "ServiceAsk", "share_budget"]
