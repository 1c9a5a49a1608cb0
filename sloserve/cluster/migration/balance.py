from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from sloserve.cluster.migration.base import (InstanceView, MigrationOptions, MigrationPolicy, MovableRequest, Move,
                                             MoveCosts, blocks_for, need_on, room_of, worth_moving)
from sloserve.cluster.routers.predicted_load import DEFAULT_DECODE_WEIGHT, InstanceLoad, instance_load, overflow_cost


@dataclass(frozen=True)
class Candidate:
    """A move balance considered, with why it scored what it did (tests read the parts)."""

    request: MovableRequest
    gain: float  # how much the pair's higher load drops, in prefill-token equivalents
    copy_s: float
    score: float  # gain per second the move takes


class BalancePolicy(MigrationPolicy):
    """Move a running request from the most to the least loaded instance when their loads differ
    by more than a threshold, pairing the k-th most loaded with the k-th least loaded.

    Load is the predicted-load router's measure (`routers.predicted_load.instance_load`): queued
    prefill tokens, weighted predicted decode tokens, and, when the instance's committed KV (blocks
    in use, its queue's, the chunks its prefills have left, its requests' predicted growth) exceeds
    its pool, the recompute of the preemptions that forces (the router's overflow cost). Routing
    balances that measure at arrival; requests then grow differently than predicted, and
    migration corrects what routing could not know.

    Of the source's requests, the move that closes the pair's gap fastest wins: the drop of the
    pair's higher load, per second of copy (plus `overhead_s`, the fixed cost of any move: the
    handshake and the stop-and-copy pause). A request whose KV takes long to copy must free
    proportionally more to be chosen, and a move that would only swap which side is loaded gains
    nothing.
    """

    name = "balance"

    def __init__(self, min_gap: float = 2048.0, rel_gap: float = 0.5, min_gain: float = 256.0,
                 decode_weight: float = DEFAULT_DECODE_WEIGHT, kv_reserve: float = 0.0, overhead_s: float = 0.02,
                 options: Optional[MigrationOptions] = None):
        """A pair is unbalanced when the gap exceeds both `min_gap` tokens and `rel_gap` x the
        source's load (so lightly loaded fleets do not churn). A move must gain at least
        `min_gain` tokens: the moved request pauses for tens of milliseconds, about what a
        few hundred tokens of prefill take, so a smaller gain does not pay for its own pause.
        `kv_reserve`: see `instance_load`."""
        self.min_gap = min_gap
        self.rel_gap = rel_gap
        self.min_gain = min_gain
        self.decode_weight = decode_weight
        self.kv_reserve = kv_reserve
        self.overhead_s = overhead_s
        self.options = options or MigrationOptions(decode_weight=decode_weight)

    @classmethod
    def from_options(cls, options: MigrationOptions) -> "BalancePolicy":
        return cls(decode_weight=options.decode_weight, options=options)

    def loads(self, views: Sequence[InstanceView]) -> dict[int, InstanceLoad]:
        return {v.instance_id: instance_load(v.state, self.decode_weight, self.kv_reserve) for v in views}

    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        loads = self.loads(views)
        total = {i: load.total for i, load in loads.items()}
        sources = sorted((v for v in views if v.running and not v.draining),
                         key=lambda v: (-total[v.instance_id], v.instance_id))
        sinks = sorted((v for v in views if v.accepting and not v.draining),
                       key=lambda v: (total[v.instance_id], v.instance_id))
        moves: list[Move] = []
        used: set[int] = set()
        for src, dst in zip(sources, sinks):
            if src.instance_id in used or dst.instance_id in used or src.instance_id == dst.instance_id:
                continue
            gap = total[src.instance_id] - total[dst.instance_id]
            if gap <= max(self.min_gap, self.rel_gap * total[src.instance_id]):
                continue
            best = self.best_move(src, dst, loads, costs)
            if best is not None:
                moves.append(costs.move(best.request, src.instance_id, dst.instance_id, self.name))
                used.update((src.instance_id, dst.instance_id))
        return moves

    def candidates(self, src: InstanceView, dst: InstanceView, loads: dict[int, InstanceLoad],
                   costs: MoveCosts) -> list[Candidate]:
        """Every request of `src` that `dst` can hold, scored."""
        ls, ld = loads[src.instance_id], loads[dst.instance_id]
        opts = self.options
        room = room_of(dst)
        out = []
        for r in src.running:
            if need_on(r, dst, opts.headroom) > room:
                continue
            copy_s = costs.copy_time(r.num_tokens, src.instance_id, dst.instance_id)
            if copy_s > opts.max_copy_s or not worth_moving(r, copy_s, opts.min_remaining_tokens):
                continue
            after_src, after_dst = self._shifted(ls, src, r, -1), self._shifted(ld, dst, r, +1)
            gain = ls.total - max(after_src, after_dst)
            if gain > 0 and gain >= self.min_gain:
                out.append(Candidate(r, gain, copy_s, gain / (copy_s + self.overhead_s)))
        return out

    def best_move(self, src: InstanceView, dst: InstanceView, loads: dict[int, InstanceLoad],
                  costs: MoveCosts) -> Optional[Candidate]:
        best: Optional[Candidate] = None
        for c in self.candidates(src, dst, loads, costs):
            if best is None or c.score > best.score:
                best = c
        return best

    def _shifted(self, load: InstanceLoad, view: InstanceView, r: MovableRequest, sign: int) -> float:
        """The instance's total load once `r` has left (sign -1) or arrived (+1)."""
        blocks = blocks_for(r.num_tokens + r.predicted_remaining, view.state.block_size)  # held and to come
        overflow = overflow_cost(view.state, load.excess_blocks + sign * blocks)
        return load.prefill + load.decode + sign * self.decode_weight * r.predicted_remaining + overflow
