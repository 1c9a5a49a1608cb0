from __future__ import annotations

from typing import Sequence

from sloserve.cluster.migration.base import InstanceView, MigrationPolicy, Move, MoveCosts

# Which policy's moves come first when several want the same request or the same instance's
# migration slot (the controller admits moves in plan order): emptying an instance is an
# obligation, a class about to miss its SLO is urgent, a request no instance can admit waits for
# room, and balance is an improvement that can wait a tick.
PRECEDENCE = ("drain", "priority", "defrag", "balance")


class CombinedPolicy(MigrationPolicy):
    """Several policies as one: the union of their moves, at most one per request, planned in
    the order of `PRECEDENCE` (drain first; policies it does not name keep their order, last)."""

    name = "combined"

    def __init__(self, policies: Sequence[MigrationPolicy]):
        rank = {name: i for i, name in enumerate(PRECEDENCE)}
        self.policies = sorted(policies, key=lambda p: rank.get(p.name, len(rank)))  # stable

    @property
    def moves_anything(self) -> bool:  # type: ignore[override]
        return any(p.moves_anything for p in self.policies)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.policies]

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        moves: list[Move] = []
        seen: set[str] = set()
        for policy in self.policies:
            for move in policy.plan(now, views, costs):
                if move.request_id not in seen:
                    seen.add(move.request_id)
                    moves.append(move)
        return moves
