"""The front's migration loop: the fleet controller's policy over the live worker fleet.

Every `interval_s` the driver shows the controller one `InstanceView` per worker (its last
polled state, and the relayed streams running there that could move) and carries out the
moves it returns, each as a live migration of one relay session (front/relay.py). Operators
reach the same path through the admin API: move one request, or drain an instance (it
leaves routing and the `drain` policy empties it, whatever `--migration` says).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Callable, Optional

from sloserve.cluster.migration.base import InstanceView, MovableRequest, Move, MoveCosts
from sloserve.fleet_view import HANDOFF
from sloserve.front.relay import MigrationOutcome
from sloserve.timeline import MIGRATION

if TYPE_CHECKING:
    from sloserve.cluster.controller import FleetController
    from sloserve.workers.fleet import Instance, WorkerFleet
    from sloserve.front.relay import RelaySession

logger = logging.getLogger(__name__)

LOOPBACK_BYTES_PER_S = 1e9  # what moving KV between two workers of one host costs, before any is measured


async def every(interval_s: float, round_: Callable[[], object], what: str) -> None:
    """Run `round_` every `interval_s` until cancelled; a round that fails is logged, and the
    next one runs anyway (one bad round must not stop a control loop for good)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            round_()
        except Exception:  # noqa: BLE001
            logger.exception("%s round failed", what)


class MigrationDriver:
    def __init__(self, fleet: "WorkerFleet", sessions: "set[RelaySession]", controller: "FleetController",
                 interval_s: float = 0.5) -> None:
        """`sessions`: the front's live set of relayed streams (the requests that can move)."""
        self.fleet = fleet
        self.sessions = sessions
        self.controller = controller
        self.interval_s = interval_s
        self.kv_bytes_per_token = 0.0  # learned from completed moves (bytes / tokens)
        self.bandwidth = LOOPBACK_BYTES_PER_S
        self._task: Optional[asyncio.Task] = None
        self._moves: set[asyncio.Task] = set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._moves) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        await every(self.interval_s, self.tick, "migration")

    # ---- one round -----------------------------------------------------------------
    def views(self) -> list[InstanceView]:
        by_slot: dict[int, list[MovableRequest]] = {}
        for session in self.sessions:
            if session.movable:
                by_slot.setdefault(session.upstream.inst.slot, []).append(self._movable(session))
        views = []
        for inst in self.fleet.instances:
            if inst.state is None or inst.status not in ("healthy", "unresponsive"):
                continue
            # a prefill instance never receives a running request (its streams leave by hand-off)
            accepting = inst.status == "healthy" and not inst.draining and inst.role != "prefill"
            views.append(InstanceView(inst.slot, inst.routing_state(self.fleet.block_size),
                                      tuple(by_slot.get(inst.slot, ())), (), accepting=accepting,
                                      draining=inst.draining))
        return views

    def _movable(self, session: "RelaySession") -> MovableRequest:
        routed = session.routed
        # No prediction: what max_tokens allows (as the scheduler's own snapshot assumes).
        predicted = routed.predicted_output_len or session.max_tokens or 0
        qos = routed.qos
        return MovableRequest(session.engine_id or routed.request_id, session.num_tokens, len(session.tokens),
                              max(0, predicted - len(session.tokens)), routed.effective_priority,
                              qos.ttft_target_s, qos.tbt_target_s, session.recent_tbt_s())

    def costs(self) -> MoveCosts:
        per_token = self.kv_bytes_per_token or 1.0
        return MoveCosts.uniform(per_token, self.bandwidth)

    def plan(self) -> list[Move]:
        """The moves the controller wants now, given the fleet as the front sees it."""
        views = self.views()
        if len(views) < 2:
            return []
        return self.controller.plan_migrations(self.fleet.clock(), views, self.costs())

    def tick(self) -> list[Move]:
        moves = self.plan()
        for move in moves:
            session = self._session(move.request_id)
            target = self._instance(move.target)
            if session is None or target is None:
                continue
            task = asyncio.get_running_loop().create_task(self.carry_out(session, target, move))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)
        return moves

    # ---- one move ------------------------------------------------------------------
    async def carry_out(self, session: "RelaySession", target: "Instance", move: Optional[Move] = None,
                        precopy: bool = True, migration_id: Optional[str] = None) -> "MigrationOutcome":
        """Migrate one relayed request to `target`, with the controller's bookkeeping (its
        counters are the front's migration metrics); the admin API calls this too.
        `migration_id`: the one a pipelined hand-off's early sends used (the source goes on
        from them); None: a fresh one."""
        source = session.upstream.inst.slot
        move = move or Move(session.engine_id or session.routed.request_id, source, target.slot, "operator")
        if move.request_id in self.controller.in_flight:
            return MigrationOutcome(False, "already migrating")
        self.controller.started(move)
        tokens = session.num_tokens
        outcome = MigrationOutcome(False, "cancelled")
        try:
            outcome = await session.migrate(target, precopy, migration_id)
        finally:
            self.controller.finished(move, outcome.ok, self.fleet.clock(), outcome.kv_bytes, outcome.downtime_s)
        if move.reason != HANDOFF:  # hand-offs are every request's: counted, not listed
            self.fleet.on_event(MIGRATION, source, f"{move.request_id} to instance {target.slot} ({move.reason}): "
                                + (f"{outcome.kv_bytes} bytes, {outcome.downtime_s * 1e3:.0f} ms down" if outcome.ok
                                   else f"aborted, {outcome.reason}"))
        if outcome.ok:
            if tokens:
                self.kv_bytes_per_token = max(self.kv_bytes_per_token, outcome.kv_bytes / tokens)
            logger.info("migrated %s from instance %d to %d (%s): %d bytes, downtime %.1f ms", move.request_id,
                        source, target.slot, move.reason, outcome.kv_bytes, outcome.downtime_s * 1e3)
        else:
            logger.info("migration of %s from instance %d to %d aborted: %s", move.request_id, source, target.slot,
                        outcome.reason)
        return outcome

    def _session(self, request_id: str) -> Optional["RelaySession"]:
        for session in self.sessions:
            if request_id in (session.engine_id, session.head.get("id"), session.routed.request_id):
                return session
        return None

    def _instance(self, slot: int) -> Optional["Instance"]:
        for inst in self.fleet.instances:
            if inst.slot == slot and inst.status == "healthy" and not inst.draining:
                return inst
        return None

    def find(self, request_id: str) -> Optional["RelaySession"]:
        return self._session(request_id)

