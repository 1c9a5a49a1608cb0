from __future__ import annotations

import math
from typing import Optional, Sequence

from sloserve.cluster.migration.base import (InstanceView, MigrationOptions, MigrationPolicy, Move, MovableRequest,
                                             MoveCosts, accepting_targets, blocks_for, need_on, room_of, roomiest,
                                             worth_moving)


class PriorityPolicy(MigrationPolicy):
    """Move lower classes off an instance where a higher class is about to miss its target.

    Two signals, per instance:
    - TTFT: a class with a TTFT target waits there, and the instance's smallest waiting slack is
      under `ttft_slack_fraction` of that target. (The state publishes one slack, the queue's
      smallest; it is attributed to the most important class waiting with a target.)
    - TBT: a running request's recent time between tokens exceeds `tbt_fraction` of its target.
    The instance scheduler already serves the higher class first; what it cannot do is shrink
    the batch or free KV without preempting someone. Moving a lower-class request elsewhere does
    both and keeps its KV: its blocks go to the waiting higher class, and the steps get lighter.
    Victims are the lowest class first; when KV is short, enough of them move to cover the
    shortfall (the smallest single one that does, else the largest first), otherwise one, the
    cheapest to copy.
    """

    name = "priority"

    def __init__(self, ttft_slack_fraction: float = 0.5, tbt_fraction: float = 1.0, max_moves_per_instance: int = 2,
                 options: Optional[MigrationOptions] = None):
        self.ttft_slack_fraction = ttft_slack_fraction
        self.tbt_fraction = tbt_fraction
        self.max_moves_per_instance = max_moves_per_instance
        self.options = options or MigrationOptions()

    @classmethod
    def from_options(cls, options: MigrationOptions) -> "PriorityPolicy":
        return cls(options=options)

    def urgent(self, view: InstanceView) -> Optional[tuple[int, Optional[MovableRequest]]]:
        """The most important class about to miss a target here, with its waiting request when
        the signal is TTFT (None for TBT); None when no class is at risk."""
        best: Optional[tuple[int, Optional[MovableRequest]]] = None
        targeted = [w for w in view.waiting if w.ttft_target_s < math.inf]
        if targeted:
            head = min(targeted, key=lambda w: (w.priority, w.ttft_target_s))
            if view.state.min_ttft_slack_s <= self.ttft_slack_fraction * head.ttft_target_s:
                best = (head.priority, head)
        for r in view.running:
            if r.tbt_s > 0 and r.tbt_s > self.tbt_fraction * r.tbt_target_s and (best is None or r.priority < best[0]):
                best = (r.priority, None)
        return best

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        room = {v.instance_id: room_of(v) for v in views}
        moves: list[Move] = []
        for view in views:
            if view.draining or not view.running:
                continue
            risk = self.urgent(view)
            if risk is None:
                continue
            cls, waiting = risk
            deficit = 0
            if waiting is not None:
                deficit = blocks_for(waiting.num_tokens, view.state.block_size) - view.state.kv_blocks_free
            for r, target in self._victims(view, cls, deficit, views, room, costs):
                moves.append(costs.move(r, view.instance_id, target.instance_id, self.name))
        return moves

    def _victims(self, view: InstanceView, cls: int, deficit: int, views: Sequence[InstanceView],
                 room: dict[int, int], costs: MoveCosts) -> list[tuple[MovableRequest, InstanceView]]:
        opts, bs, src = self.options, view.state.block_size, view.instance_id
        sinks = accepting_targets(views, src)
        lower = []
        for r in view.running:
            if r.priority <= cls:
                continue
            copy_s = min((costs.copy_time(r.num_tokens, src, t.instance_id) for t in sinks), default=math.inf)
            if copy_s <= opts.max_copy_s and worth_moving(r, copy_s, opts.min_remaining_tokens):
                lower.append(r)
        if not lower:
            return []
        held = {r.request_id: blocks_for(r.num_tokens, bs) for r in lower}
        lowest = max(r.priority for r in lower)
        if deficit > 0:
            # the lowest class pays first; within it, the smallest request that covers the
            # shortfall alone, else the largest ones
            covering = [r for r in lower if r.priority == lowest and held[r.request_id] >= deficit]
            order = ([min(covering, key=lambda r: (held[r.request_id], r.request_id))] if covering else
                     sorted(lower, key=lambda r: (-r.priority, -held[r.request_id], r.request_id)))
        else:
            order = sorted(lower, key=lambda r: (-r.priority, held[r.request_id], r.request_id))
        chosen: list[tuple[MovableRequest, InstanceView]] = []
        for r in order:
            if len(chosen) >= self.max_moves_per_instance or (chosen and deficit <= 0):
                break
            target = roomiest(r, sinks, room, opts.headroom)
            if target is None:
                continue
            room[target.instance_id] -= need_on(r, target, 0.0)
            deficit -= held[r.request_id]
            chosen.append((r, target))
        return chosen
