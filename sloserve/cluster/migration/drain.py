from __future__ import annotations

from typing import Optional, Sequence

from sloserve.cluster.migration.base import (InstanceView, MigrationOptions, MigrationPolicy, Move, MoveCosts,
                                             accepting_targets, need_on, room_of, roomiest)


class DrainPolicy(MigrationPolicy):
    """Empty the instances marked `draining` (scale-down, an operator's drain, a degraded
    instance failing over) onto accepting ones, the roomiest first.

    The request with the most predicted work left moves first: it would hold the instance the
    longest. With `finish_in_place`, a request whose remaining decode (at its recent TBT) ends
    before its copy would is left to finish where it is. Requests that fit nowhere now are
    planned again on the next tick, once some room has freed. Waiting requests are not this
    policy's: the front re-routes those.
    """

    name = "drain"

    def __init__(self, finish_in_place: bool = True, options: Optional[MigrationOptions] = None):
        self.finish_in_place = finish_in_place
        self.options = options or MigrationOptions()

    @classmethod
    def from_options(cls, options: MigrationOptions) -> "DrainPolicy":
        return cls(options=options)

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        room = {v.instance_id: room_of(v) for v in views}
        moves: list[Move] = []
        for view in views:
            if not view.draining:
                continue
            sinks = accepting_targets(views, view.instance_id)
            for r in sorted(view.running, key=lambda r: (-r.predicted_remaining, r.request_id)):
                target = roomiest(r, sinks, room, self.options.headroom)
                if target is None:
                    continue
                move = costs.move(r, view.instance_id, target.instance_id, self.name)
                if self.finish_in_place and r.tbt_s > 0 and 0 < r.predicted_remaining * r.tbt_s < move.est_copy_s:
                    continue
                room[target.instance_id] -= need_on(r, target, 0.0)
                moves.append(move)
        return moves
