"""Live migration between simulated instances, priced on the link between them.

The controller decides which moves start; this carries them out the way the real transfer path
does (Llumnix-style), with the real schedulers and KV managers on both ends:

1. start: the target reserves blocks for the request's KV as it is now (no room: abort);
2. pre-copy: the KV is sent while the request keeps decoding on the source; each round then
   sends what the source computed meanwhile, until `cluster/migration/precopy.PrecopyRule` says stop;
3. stop-and-copy: at the source's next step boundary the request is suspended (it keeps its
   blocks, nothing writes them) and its size is final: the target tops up its reservation (no
   room: abort, and the request goes on at the source), the last tokens' KV is sent, and the
   handoff takes `handoff_s`. Then the source drops the request and frees its blocks;
4. adopt, at the target's next step boundary (an engine takes a request in between steps): the
   target adopts it in its reserved blocks and schedules its next token.
A request that finished or lost its KV (preempted) before it was suspended aborts its move.

Every change to an instance's scheduler is preceded by `catch_up` (a fast-forwarded decode run
applied up to now, as a router's read would) and followed by the simulator's `touch` (wake it
or cut its run at the step in flight), so fast-forward changes no decision.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sloserve.cluster.migration.precopy import PrecopyRule
from sloserve.fleet_view import HANDOFF, FleetDecisions, InstanceView, MovableRequest, Move, MoveCosts
from sloserve.sched.live_state import LiveInstanceState
from sloserve.sim.instance import SimInstance
from sloserve.core.types import Request, RequestStatus

logger = logging.getLogger(__name__)

PRECOPY, SUSPENDING, STOP_COPY, ADOPTING = "precopy", "suspending", "stop-copy", "adopting"


def movable(request: Request) -> MovableRequest:
    """What a policy sees of a request: its size, its predicted remaining decode, its class, and
    its mean time between tokens so far (what the trace of its tokens tells)."""
    n_out = len(request.output_token_ids)
    expected = request.predicted_output_len if request.predicted_output_len is not None else request.max_output_tokens
    tbt = 0.0
    if n_out > 1 and request.first_token_time is not None and request.last_token_time is not None:
        tbt = (request.last_token_time - request.first_token_time) / (n_out - 1)
    qos = request.qos
    return MovableRequest(request.request_id, request.num_prompt_tokens + n_out, n_out,
                          max(0, (expected or 0) - n_out), request.effective_priority, qos.ttft_target_s,
                          qos.tbt_target_s, tbt)


class LazyMovables(SequenceABC):
    """Requests as `MovableRequest`s, made on first access: a policy reads the requests of a few
    instances per tick (the most loaded, the draining), not of the whole fleet."""

    __slots__ = ("_requests", "_made")

    def __init__(self, requests: list[Request]):
        self._requests = requests
        self._made: Optional[list[MovableRequest]] = None

    def _all(self) -> list[MovableRequest]:
        if self._made is None:
            self._made = [movable(r) for r in self._requests]
        return self._made

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, i):  # type: ignore[override]
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())


def decode_phase(request: Request) -> bool:
    """Every token but the last computed: the only point where a request can move."""
    return request.num_prompt_tokens + len(request.output_token_ids) - request.num_computed_tokens == 1


@dataclass
class Transfer:
    """One migration in progress."""

    move: Move
    request: Request
    source: SimInstance
    target: SimInstance
    blocks: list[int]  # held on the target for the KV in transit
    copied: int  # tokens whose KV has been sent
    preemptions: int  # the request's preemption count at the start: a preemption voids the copy
    phase: str = PRECOPY
    rounds: int = 1
    suspended_at: float = 0.0


class SimMigrator:
    """Runs a controller's migrations on simulated instances (see the module docstring).

    `schedule(time, transfer)` asks the simulator for an event that calls `advance(transfer)`
    back; `touch(instance)` tells it the instance's schedule may have changed."""

    def __init__(self, controller: FleetDecisions, instances: Sequence[SimInstance],
                 states: Sequence[LiveInstanceState], costs: MoveCosts,
                 schedule: Callable[[float, Transfer], None], touch: Callable[[SimInstance], None],
                 handoff_s: float = 0.005, precopy: PrecopyRule = PrecopyRule()):
        self.controller = controller
        self.instances = list(instances)
        self.states = list(states)
        self._by_id = {i.instance_id: i for i in self.instances}
        self.costs = costs
        self._schedule = schedule
        self._touch = touch
        self.handoff_s = handoff_s
        self.precopy = precopy
        self.transfers: dict[str, Transfer] = {}
        self._at_boundary: dict[int, list[Transfer]] = {}  # instance id -> transfers waiting for its step to end
        self._bytes: dict[str, int] = {}  # bytes sent so far per transfer
        self.draining: set[int] = set()  # instances being emptied (the simulator's drains)
        self.prefill_ids: set[int] = set()  # prefill-role instances: they hand off, they take no migration
        self.offline: set[int] = set()  # stopped or still starting (autoscaling): not part of the fleet now
        # Told of every transfer that ended (move, ok, now, bytes sent, downtime): the fleet timeline.
        self.on_moved: Optional[Callable[[Move, bool, float, int, float], None]] = None

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    # ---- planning ----------------------------------------------------------------------
    def views(self, now: float) -> list[InstanceView]:
        """The fleet as the policies see it, at `now` (every instance caught up first)."""
        out = []
        for instance, state in zip(self.instances, self.states):
            if instance.instance_id in self.offline:
                continue
            instance.catch_up(now)
            s = instance.scheduler
            prefill = instance.instance_id in self.prefill_ids
            running = [] if prefill else [r for r in s.running if decode_phase(r) and r.request_id not in self.transfers]
            drained = instance.instance_id in self.draining
            out.append(InstanceView(instance.instance_id, state, LazyMovables(running), LazyMovables(s.waiting),
                                    accepting=not (drained or prefill), draining=drained))
        return out

    def tick(self, now: float) -> None:
        """Plan, and start what the controller lets through."""
        for move in self.controller.plan_migrations(now, self.views(now), self.costs):
            self._start(move, now)

    def _start(self, move: Move, now: float) -> None:
        source, target = self._by_id[move.source], self._by_id[move.target]
        request = source.scheduler.requests.get(move.request_id)
        self.controller.started(move)
        if request is None or request.status is not RequestStatus.RUNNING or not decode_phase(request):
            self.controller.finished(move, False, now)
            return
        target.catch_up(now)
        blocks = target.kv.reserve(target.kv.blocks_needed(request.num_computed_tokens)) \
            if self._has_seat(target) else None
        if blocks is None:
            logger.debug("migration of %s aborted: instance %d has no room", move.request_id, move.target)
            self.controller.finished(move, False, now)
            return
        self._touch(target)  # fewer free blocks: a run planned on them must end at the step in flight
        transfer = Transfer(move, request, source, target, blocks, request.num_computed_tokens,
                            request.num_preemptions)
        self.transfers[move.request_id] = transfer
        self._bytes[move.request_id] = self.costs.kv_bytes(transfer.copied)
        self._schedule(now + self._copy_time(transfer, transfer.copied), transfer)

    def _has_seat(self, target: SimInstance) -> bool:
        """A batch seat on `target` beside those promised to the transfers already bound for it."""
        incoming = sum(1 for t in self.transfers.values() if t.target is target)
        return target.scheduler.has_seat(incoming)

    # ---- prefill/decode hand-off ---------------------------------------------------------
    def handoff(self, request: Request, source: SimInstance, target: SimInstance, now: float,
                pipelined_with_s: float = 0.0, num_layers: int = 1) -> bool:
        """Move a request that has just got its first token on a prefill instance (which is between
        steps) to a decode instance: hold room there, stop it here, send its KV, and let the
        target adopt it. The send is the stop-and-copy of a migration without pre-copy rounds.
        `pipelined_with_s`: seconds of the prefill the send overlapped (its KV streamed layer by
        layer while later chunks and layers computed), so only what is left of it, and at least
        the last layer's share, is waited for. False (nothing changed) when the target has no room
        (KV blocks or a batch seat)."""
        rid = request.request_id
        n = request.num_computed_tokens
        move = Move(rid, source.instance_id, target.instance_id, HANDOFF, self.costs.kv_bytes(n),
                    self.costs.copy_time(n, source.instance_id, target.instance_id))
        target.catch_up(now)
        if not self._has_seat(target):
            return False
        blocks = target.kv.reserve(target.kv.blocks_needed(n))
        if blocks is None:
            return False
        if source.scheduler.suspend(rid) is None:
            target.kv.unpin(blocks)
            return False
        self.controller.started(move)
        self._touch(target)
        transfer = Transfer(move, request, source, target, blocks, n, request.num_preemptions, phase=STOP_COPY,
                            suspended_at=now)
        self.transfers[rid] = transfer
        self._bytes[rid] = move.kv_bytes
        wait = max(move.est_copy_s - pipelined_with_s, move.est_copy_s / max(1, num_layers)) \
            if pipelined_with_s > 0 else move.est_copy_s
        self._schedule(now + wait + self.handoff_s, transfer)
        return True

    # ---- the phases ----------------------------------------------------------------------
    def advance(self, transfer: Transfer, now: float) -> None:
        """A copy phase of `transfer` ended at `now`."""
        if transfer.phase == STOP_COPY:
            self._release(transfer, now)
            return
        source = transfer.source
        source.catch_up(now)
        if not self._intact(transfer):
            self._abort(transfer, now)
            return
        delta = transfer.request.num_computed_tokens - transfer.copied
        if self.precopy.another_round(transfer.rounds, delta, source.kv.block_size):
            transfer.rounds += 1
            self._send(transfer, delta)
            self._schedule(now + self._copy_time(transfer, delta), transfer)
            return
        transfer.phase = SUSPENDING
        self._at_next_boundary(source, transfer, now)

    def _at_next_boundary(self, instance: SimInstance, transfer: Transfer, now: float) -> None:
        """Take the next step of `transfer` between two steps of `instance`: now if it is idle,
        else when its step in flight ends (a fast-forwarded run is cut there)."""
        if instance.is_busy:
            self._at_boundary.setdefault(instance.instance_id, []).append(transfer)
            self._touch(instance)
        else:
            self._between_steps(transfer, now)

    def at_step_boundary(self, instance: SimInstance, now: float) -> None:
        """`instance` finished a step and plans its next one right after: do what waits for that."""
        for transfer in self._at_boundary.pop(instance.instance_id, ()):
            self._between_steps(transfer, now)

    def _between_steps(self, transfer: Transfer, now: float) -> None:
        if transfer.phase == SUSPENDING:
            self._suspend(transfer, now)
        else:
            self._adopt(transfer, now)

    def _suspend(self, transfer: Transfer, now: float) -> None:
        """At the source's step boundary: stop the request, hold room for all of it on the
        target, and send the rest of its KV."""
        request, source, target = transfer.request, transfer.source, transfer.target
        rid = request.request_id
        if not self._intact(transfer) or source.scheduler.suspend(rid) is None:
            self._abort(transfer, now)
            return
        target.catch_up(now)
        more = target.kv.blocks_needed(request.num_computed_tokens) - len(transfer.blocks)
        extra = target.kv.reserve(more) if more > 0 else []
        if extra is None:  # the target filled up meanwhile: the request goes on here
            source.scheduler.unsuspend(rid, now)  # (the source is between steps: nothing to catch up)
            self._touch(source)
            self._abort(transfer, now)
            return
        if extra:
            transfer.blocks.extend(extra)
            self._touch(target)
        transfer.phase = STOP_COPY
        transfer.suspended_at = now
        delta = request.num_computed_tokens - transfer.copied
        self._send(transfer, delta)
        self._schedule(now + self._copy_time(transfer, delta) + self.handoff_s, transfer)

    def _release(self, transfer: Transfer, now: float) -> None:
        """The last bytes arrived: the source lets the request go and frees its blocks; the
        target takes it between two of its steps."""
        source = transfer.source
        source.catch_up(now)
        source.scheduler.drop_suspended(transfer.request.request_id, now)
        self._touch(source)
        transfer.phase = ADOPTING
        self._at_next_boundary(transfer.target, transfer, now)

    def _adopt(self, transfer: Transfer, now: float) -> None:
        request, target = transfer.request, transfer.target
        rid = request.request_id
        target.catch_up(now)
        target.adopt(request, transfer.blocks, now)
        self._touch(target)
        del self.transfers[rid]
        sent = self._bytes.pop(rid)
        self.controller.finished(transfer.move, True, now, bytes_sent=sent, downtime_s=now - transfer.suspended_at)
        if self.on_moved is not None:
            self.on_moved(transfer.move, True, now, sent, now - transfer.suspended_at)

    def _abort(self, transfer: Transfer, now: float) -> None:
        rid = transfer.move.request_id
        target = transfer.target
        target.catch_up(now)
        target.kv.unpin(transfer.blocks)
        self._touch(target)
        del self.transfers[rid]
        self._bytes.pop(rid, None)
        self.controller.finished(transfer.move, False, now)
        if self.on_moved is not None:
            self.on_moved(transfer.move, False, now, 0, 0.0)
        logger.debug("migration of %s aborted at %.3f (%s)", rid, now, transfer.phase)

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _intact(transfer: Transfer) -> bool:
        """Still running on the source with the KV being copied (not finished, not preempted)."""
        r = transfer.request
        return (transfer.source.scheduler.requests.get(r.request_id) is r and r.num_preemptions == transfer.preemptions
                and r.status in (RequestStatus.RUNNING, RequestStatus.MIGRATING))

    def _send(self, transfer: Transfer, tokens: int) -> None:
        transfer.copied += tokens
        self._bytes[transfer.move.request_id] += self.costs.kv_bytes(tokens)

    def _copy_time(self, transfer: Transfer, tokens: int) -> float:
        return self.costs.copy_time(tokens, transfer.move.source, transfer.move.target)
