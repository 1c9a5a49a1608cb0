"""The migration interface, shared by the real multi-instance front and the simulator.

A policy sees one `InstanceView` per instance (its state plus the requests that may move) and
what a move costs on this fleet, and returns the moves it wants. It never reads the wall clock
(`now` comes in) and never executes anything: the `FleetController` filters the moves
(concurrency, cooldown, targets that accept) and the fleet's backend carries them out (a live
pre-copy of the KV while the request keeps decoding, then a short stop-and-copy).

Pure Python, like the routers: a simulated fleet plans migrations ten times a second.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional, Sequence

from sloserve.cluster.routers.predicted_load import DEFAULT_DECODE_WEIGHT
from sloserve.fleet_view import InstanceView, MovableRequest, Move, MoveCosts


@dataclass(frozen=True)
class MigrationOptions:
    """Knobs several policies share; each policy's own thresholds are its constructor's."""

    max_copy_s: float = 2.0  # never start a move whose full copy would take longer
    min_remaining_tokens: int = 8  # a request predicted to end sooner stays where it is
    headroom: float = 0.02  # share of a target's pool left free after a move (above its watermark)
    decode_weight: float = DEFAULT_DECODE_WEIGHT  # the predicted-load measure's weight of decode tokens


class MigrationPolicy(ABC):
    name: ClassVar[str]
    moves_anything: ClassVar[bool] = True  # False: a fleet need not even build views for it

    @classmethod
    def from_options(cls, options: MigrationOptions) -> "MigrationPolicy":
        """Build the policy from shared options (policies without knobs ignore them)."""
        return cls()

    @abstractmethod
    def plan(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        """Moves this policy wants now (the controller decides which of them start)."""


# ---- helpers the policies share -------------------------------------------------------------

def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def room_of(view: InstanceView) -> int:
    """Blocks an instance can give a migrated request: free ones, minus what its own queue will take."""
    return max(0, view.state.kv_blocks_free - view.state.kv_blocks_waiting)


def accepting_targets(views: Sequence[InstanceView], exclude: int) -> list[InstanceView]:
    """Instances that may receive a move from `exclude`."""
    return [v for v in views if v.accepting and not v.draining and v.instance_id != exclude]


def need_on(request: MovableRequest, view: InstanceView, headroom: float) -> int:
    """Blocks a target must have free to take `request` (its KV, its next token, the headroom)."""
    return blocks_for(request.num_tokens + 1, view.state.block_size) + math.ceil(headroom * view.state.kv_blocks_total)


def worth_moving(request: MovableRequest, copy_s: float, min_remaining_tokens: int) -> bool:
    """A request about to finish is not worth its copy: it would end on the source before
    (or soon after) its KV arrived. With a known TBT, compare the time it has left with the
    copy; otherwise require `min_remaining_tokens` predicted tokens (0: unknown, allowed)."""
    if request.predicted_remaining <= 0:
        return True  # no prediction: the policy's own gain decides
    if request.predicted_remaining < min_remaining_tokens:
        return False
    return request.tbt_s <= 0 or request.predicted_remaining * request.tbt_s > copy_s


def roomiest(request: MovableRequest, candidates: Iterable[InstanceView], room: dict[int, int],
             headroom: float) -> Optional[InstanceView]:
    """The candidate with the most room (`room`: blocks per instance id, which the caller lowers
    as it plans moves) that holds the request with headroom to spare; None if none does.
    Ties go to the lowest instance id (candidates come in view order)."""
    best: Optional[InstanceView] = None
    for v in candidates:
        if room[v.instance_id] >= need_on(request, v, headroom) and (
                best is None or room[v.instance_id] > room[best.instance_id]):
            best = v
    return best
