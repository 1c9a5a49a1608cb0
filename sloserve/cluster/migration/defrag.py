from __future__ import annotations

import math
from typing import Optional, Sequence

from sloserve.cluster.migration.base import (InstanceView, MigrationOptions, MigrationPolicy, Move, MovableRequest,
                                             MoveCosts, accepting_targets, blocks_for, need_on, room_of, roomiest,
                                             worth_moving)


class DefragPolicy(MigrationPolicy):
    """Make room for a request no instance can take.

    KV is spread over the fleet in pieces: a long prompt may wait for a pool that has room nowhere
    while every instance has some blocks free. When the head of an instance's queue needs more
    blocks than any instance has free, running requests move off *that* instance (where it already
    waits) to instances with room, until its prompt fits there. The smallest single request that
    covers the shortfall moves if one does (the cheapest copy); otherwise the largest ones, fewest
    moves first. Nothing moves unless the whole shortfall can be covered: partial room helps no one.
    """

    name = "defrag"

    def __init__(self, max_moves_per_instance: int = 4, options: Optional[MigrationOptions] = None):
        self.max_moves_per_instance = max_moves_per_instance
        self.options = options or MigrationOptions()

    @classmethod
    def from_options(cls, options: MigrationOptions) -> "DefragPolicy":
        return cls(options=options)

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        room = {v.instance_id: room_of(v) for v in views}
        most_free = max((v.state.kv_blocks_free for v in views if v.accepting and not v.draining), default=0)
        moves: list[Move] = []
        for view in views:
            if not view.waiting or not view.running or view.draining:
                continue
            need = blocks_for(view.waiting[0].num_tokens, view.state.block_size)
            if need <= most_free or need > view.state.kv_blocks_total:
                continue  # someone can admit it (routing's business), or nothing ever will
            chosen = self._cover(view, need - view.state.kv_blocks_free, views, room, costs)
            for r, target in chosen:
                moves.append(costs.move(r, view.instance_id, target.instance_id, self.name))
        return moves

    def _cover(self, view: InstanceView, deficit: int, views: Sequence[InstanceView], room: dict[int, int],
               costs: MoveCosts) -> list[tuple[MovableRequest, InstanceView]]:
        """Requests of `view` whose blocks sum to `deficit`, each with a target; [] if impossible."""
        opts, bs, src = self.options, view.state.block_size, view.instance_id
        sinks = accepting_targets(views, src)
        movable = []
        for r in view.running:
            copy_s = min((costs.copy_time(r.num_tokens, src, t.instance_id) for t in sinks), default=math.inf)
            if copy_s <= opts.max_copy_s and worth_moving(r, copy_s, opts.min_remaining_tokens):
                movable.append(r)
        held = {r.request_id: blocks_for(r.num_tokens, bs) for r in movable}
        single = [r for r in movable if held[r.request_id] >= deficit]
        order = [min(single, key=lambda r: (held[r.request_id], r.request_id))] if single else sorted(
            movable, key=lambda r: (-held[r.request_id], r.request_id))
        trial = dict(room)
        chosen: list[tuple[MovableRequest, InstanceView]] = []
        for r in order:
            if deficit <= 0 or len(chosen) >= self.max_moves_per_instance:
                break
            target = roomiest(r, sinks, trial, opts.headroom)
            if target is None:
                continue
            trial[target.instance_id] -= need_on(r, target, 0.0)
            deficit -= held[r.request_id]
            chosen.append((r, target))
        if deficit > 0:
            return []
        room.update(trial)
        return chosen
