"""The fleet controller: one object that makes the cluster-level decisions for a fleet, real or
simulated. It routes arrivals, picks the decode instance a prefill hands a request to
(prefill/decode disaggregation), plans migrations, and decides how many instances run
(autoscaling: `plan_scaling`, through an `autoscale.ScalePlanner`).

It decides and keeps books; it never executes. The backend (the simulator, or the real front
with its worker handles) asks it where a request goes and which moves to start, carries the
moves out, and reports back with `started` and `finished`. Pure Python, time passed in.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Optional, Sequence

from sloserve.cluster.autoscale.planner import ScalePlanner
from sloserve.cluster.migration import InstanceView, MigrationPolicy, Move, MoveCosts
from sloserve.cluster.mixed_handoff import MixedHandoff, NeverHandOff
from sloserve.cluster.routers.base import Router
from sloserve.fleet_view import HANDOFF, InstanceSlot, ScalingPlan, ScalingSignals
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request

logger = logging.getLogger(__name__)


@dataclass
class MigrationCounters:
    started: int = 0
    completed: int = 0
    aborted: int = 0  # includes moves that could not even start (the target had no room)
    bytes: int = 0  # KV bytes sent by completed moves (pre-copy and stop-and-copy)
    downtime_s: float = 0.0  # sum over completed moves of the time the request was paused

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class FleetController:
    """Routing plus migration planning with the bookkeeping that keeps moves safe:

    - a request already migrating is not moved again;
    - at most `max_concurrent_per_instance` migrations leave, and as many arrive at, one instance
      at a time (a link and a scheduler handle few copies at once; a source sending many
      requests away at once would leave its batch in pieces);
    - a request that moved (or failed to) waits `min_interval_s` before it may move again, so
      two policies, or two ticks with stale views, cannot bounce it between instances;
    - a target that does not accept (draining, unhealthy) never receives one.
    """

    def __init__(self, router: Router, migration: Optional[MigrationPolicy] = None,
                 max_concurrent_per_instance: int = 1, min_interval_s: float = 2.0,
                 decode_router: Optional[Router] = None, scalers: Optional[Mapping[str, ScalePlanner]] = None,
                 mixed_handoff: Optional[MixedHandoff] = None):
        """`decode_router` picks the decode instance of a prefill/decode hand-off (default:
        `router`). Hand-offs are counted apart from migrations (`handoff_counters`) and are
        not subject to the per-instance caps: every request on a prefill instance makes one.
        `scalers`: a scale planner per pool ("mixed"; or "prefill" and "decode", scaled apart).
        `mixed_handoff` (default: never) decides whether a request prefilled on a mixed instance
        decodes on another one (`route_mixed_handoff`)."""
        if max_concurrent_per_instance < 1:
            raise ValueError("max_concurrent_per_instance must be >= 1")
        self.router = router
        self.decode_router = decode_router or router
        self.mixed_handoff = mixed_handoff or NeverHandOff()
        self.scalers = dict(scalers or {})
        self.migration = migration
        self.max_concurrent_per_instance = max_concurrent_per_instance
        self.min_interval_s = min_interval_s
        self.in_flight: dict[str, Move] = {}
        self._last_moved: dict[str, float] = {}  # request id -> when its last migration ended
        self._out: dict[int, int] = {}  # instance id -> migrations leaving it now
        self._in: dict[int, int] = {}
        self._counters = MigrationCounters()
        self._handoffs = MigrationCounters()
        self.completed_by_reason: dict[str, int] = {}  # policy name -> completed moves it asked for

    # ---- routing ---------------------------------------------------------------------
    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        return self.router.route(request, states)

    def route_decode(self, request: Request, states: Sequence[InstanceState]) -> int:
        """The decode instance (index into `states`) a prefilled request moves to."""
        return self.decode_router.route(request, states)

    def route_mixed_handoff(self, request: Request, source: InstanceState,
                            others: Sequence[InstanceState]) -> Optional[int]:
        """Where (index into `others`, the other mixed instances that accept) a request that just
        got its first token on a mixed instance goes to decode, or None: it stays."""
        if not others or not self.mixed_handoff.considers(source):
            return None
        k = self.decode_router.route(request, others)
        return k if self.mixed_handoff.pays(source, others[k]) else None

    @staticmethod
    def handoff_pays(remaining_tokens: Optional[int], token_time_s: float, handoff_time_s: float) -> bool:
        """Whether a request that has its first token on a prefill instance should move to a
        decode instance: not when what it may still decode (at most `remaining_tokens`, its
        max_tokens less what it has; None: unbounded) takes no longer where it is, at
        `token_time_s` a token, than the hand-off's own pause (`handoff_time_s`: from its first
        token there to its next on the decode instance). Moving it would only delay it, and race
        its end on the prefill instance."""
        return remaining_tokens is None or remaining_tokens * token_time_s > handoff_time_s

    @property
    def handoff_counters(self) -> dict[str, float]:
        return self._handoffs.as_dict()

    # ---- autoscaling -----------------------------------------------------------------
    def plan_scaling(self, signals: ScalingSignals, slots: Sequence[InstanceSlot]) -> Optional[ScalingPlan]:
        """Instances of `signals.pool` to start, take back, cancel and drain now (None: this pool
        does not scale)."""
        scaler = self.scalers.get(signals.pool)
        return None if scaler is None else scaler.plan(signals, slots)

    # ---- migration -------------------------------------------------------------------
    @property
    def migration_enabled(self) -> bool:
        return self.migration is not None and self.migration.moves_anything

    @property
    def counters(self) -> dict[str, float]:
        return self._counters.as_dict()

    def plan_migrations(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]:
        """The moves to start now: the policy's, minus those the rules above forbid. Requests
        the rules exclude are hidden from the policy first, so it picks among the ones it may move."""
        if not self.migration_enabled:
            return []
        self._forget_before(now - self.min_interval_s)
        blocked = self.in_flight.keys() | self._last_moved.keys()
        if blocked:
            views = [replace(v, running=[r for r in v.running if r.request_id not in blocked])
                     if any(r.request_id in blocked for r in v.running) else v for v in views]
        accepting = {v.instance_id for v in views if v.accepting}
        out, into = dict(self._out), dict(self._in)
        cap = self.max_concurrent_per_instance
        chosen: list[Move] = []
        seen: set[str] = set()
        for move in self.migration.plan(now, views, costs):  # type: ignore[union-attr]
            if (move.request_id in blocked or move.request_id in seen or move.source == move.target
                    or move.target not in accepting or out.get(move.source, 0) >= cap
                    or into.get(move.target, 0) >= cap):
                continue
            seen.add(move.request_id)
            out[move.source] = out.get(move.source, 0) + 1
            into[move.target] = into.get(move.target, 0) + 1
            chosen.append(move)
        return chosen

    def started(self, move: Move) -> None:
        """The backend began `move` (call once per move it starts, before `finished`)."""
        if move.request_id in self.in_flight:
            raise ValueError(f"{move.request_id} is already migrating")
        self.in_flight[move.request_id] = move
        if move.reason == HANDOFF:
            self._handoffs.started += 1
            return
        self._out[move.source] = self._out.get(move.source, 0) + 1
        self._in[move.target] = self._in.get(move.target, 0) + 1
        self._counters.started += 1
        logger.debug("migration of %s: %d -> %d (%s) started", move.request_id, move.source, move.target, move.reason)

    def finished(self, move: Move, ok: bool, now: float, bytes_sent: Optional[int] = None,
                 downtime_s: float = 0.0) -> None:
        """`move` ended: completed (`ok`) or aborted. `bytes_sent` defaults to the planned KV."""
        if self.in_flight.pop(move.request_id, None) is None:
            raise ValueError(f"{move.request_id} is not migrating")
        if move.reason == HANDOFF:
            h = self._handoffs
            if ok:
                h.completed += 1
                h.bytes += move.kv_bytes if bytes_sent is None else bytes_sent
                h.downtime_s += downtime_s
            else:
                h.aborted += 1
            return
        for side, instance in ((self._out, move.source), (self._in, move.target)):
            side[instance] -= 1
            if not side[instance]:
                del side[instance]
        self._last_moved[move.request_id] = now
        c = self._counters
        if ok:
            c.completed += 1
            self.completed_by_reason[move.reason] = self.completed_by_reason.get(move.reason, 0) + 1
            c.bytes += move.kv_bytes if bytes_sent is None else bytes_sent
            c.downtime_s += downtime_s
        else:
            c.aborted += 1
        logger.debug("migration of %s %s at %.3f", move.request_id, "completed" if ok else "aborted", now)

    def _forget_before(self, cutoff: float) -> None:
        """Drop cooldowns that ended (keeps the table as small as the moves of the last interval)."""
        if self._last_moved and min(self._last_moved.values()) <= cutoff:
            self._last_moved = {rid: t for rid, t in self._last_moved.items() if t > cutoff}
