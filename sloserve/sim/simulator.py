"""The discrete-event loop: arrivals, routing and step completions on a heap of timed events.

No polling: an instance is woken only by an event that can change what it does (a request
routed to it, the end of its own step, a request migrated to or from it). Simulated time never
touches the wall clock. With a migration policy, the fleet controller plans moves on a control
tick every `migration_interval_s`, and only while the fleet has work.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator, Optional

from sloserve.fleet_view import HANDOFF, READY as SLOT_READY, ROLES, STARTING, FleetDecisions, MoveCosts
from sloserve.sched.live_state import Moment
from sloserve.sim.clocking import energy_summary
from sloserve.sim.instance import SimInstance
from sloserve.sim.migration import SimMigrator, Transfer
from sloserve.sim.scaling import ScalingSpec, SimScaling
from sloserve import timeline as tl
from sloserve.core.types import Request

logger = logging.getLogger(__name__)

# At equal times: every arrival is queued first, then idle instances wake (so requests that
# arrive together share the first step, as they would in the engine loop), then the control tick
# and migration phases run, then steps end. Whatever reads an instance before its step's end
# event sees that step in flight, as `SimInstance.sync` (steps ending strictly before now) does.
ARRIVAL, WAKE, TICK, MIGRATE, STEP_END, SCALE, SAMPLE = 0, 1, 2, 3, 4, 5, 6
DRAIN = -1  # before anything else at its time: an arrival then already avoids the instance
READY = -2  # an instance's cold start ends: arrivals at that moment may already go to it


@dataclass
class FinishedOn:
    """A request the simulated fleet finished, and the instance it finished on."""

    request: Request
    instance_id: int


@dataclass
class _Run:
    """What one `Simulator.run` carries between its events: the arrivals still to pull and what
    finished or was rejected (handed to `on_done` when given, else kept for the result)."""

    arrivals: Iterator[Request]
    on_done: Optional[Callable[[Request, Optional[str]], None]]
    finished: list[FinishedOn] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    num_finished: int = 0
    last_arrival: float = -float("inf")

    def reject(self, request: Request, error: str) -> None:
        if self.on_done is not None:
            self.on_done(request, error)
        else:
            self.rejected.append((request, error))


@dataclass
class SimResult:
    finished: list[FinishedOn]  # empty when the run reported requests through `on_done`
    rejected: list[tuple[Request, str]]  # requests no instance could accept, with the reason
    end_time: float
    num_events: int
    num_finished: int = 0
    instance_busy_time: list[float] = field(default_factory=list)
    # the controller's migration counters (started, completed, aborted, bytes, downtime_s); empty without migration
    migration: dict[str, float] = field(default_factory=dict)
    # the same counters for prefill -> decode hand-offs; empty in a fleet without prefill instances
    handoffs: dict[str, float] = field(default_factory=dict)
    # autoscaling: instance_seconds / instance_hours, cold and warm starts, the timeline and the decisions
    scaling: dict = field(default_factory=dict)
    # with a clock policy (sim/clocking.py): joules of the steps and of idle time, mean clocks
    energy: dict = field(default_factory=dict)
    # per instance, with an expert placement (sim/experts.py): re-placements, moves, stalls, stragglers
    experts: list = field(default_factory=list)
    # per instance, pipeline-parallel (sim/pipeline.py): partitions, layer moves, stalls, stage imbalance
    stages: list = field(default_factory=list)


class RoutingOnly:
    """A bare router as the simulator's controller: routes, never migrates."""

    migration_enabled = False
    counters: dict[str, float] = {}

    def __init__(self, router) -> None:
        self.router = router

    def route(self, request: Request, states) -> int:
        return self.router.route(request, states)

    def route_decode(self, request: Request, states) -> int:
        return self.router.route(request, states)

    def plan_migrations(self, now, views, costs) -> list:
        return []

    def plan_scaling(self, signals, slots):
        return None


class Simulator:
    def __init__(self, instances: Sequence[SimInstance], controller: "FleetDecisions | object",
                 costs: Optional[MoveCosts] = None, migration_interval_s: float = 0.1, handoff_s: float = 0.005,
                 roles: Optional[Sequence[str]] = None, pd_transfer: str = "pipelined", num_layers: int = 1,
                 scaling: Optional[ScalingSpec] = None):
        """`controller`: a FleetController, or a bare router (routing only). `costs` price
        migrations (needed when the controller has a migration policy, or the fleet is
        disaggregated); `handoff_s` is the fixed part of a migration's pause (the last round trip
        before the target takes over). `roles` (one of fleet_view.ROLES per instance; default all
        `mixed`) disaggregates prefill and decode: arrivals go to prefill (and mixed) instances,
        and a prefill instance hands each request to a decode instance after its first token,
        its KV sent `pd_transfer` = "blocking" (after the prefill) or "pipelined" (layer by layer
        while it runs: only the rest, at least one layer's share of `num_layers`, is waited for).
        With `scaling`, `instances` are the slots of an autoscaled fleet (sim/scaling.py): the
        controller's scale planner decides every `scaling.interval_s` which of them run."""
        if not instances:
            raise ValueError("need at least one instance")
        self.roles = list(roles) if roles is not None else ["mixed"] * len(instances)
        if len(self.roles) != len(instances) or any(r not in ROLES for r in self.roles):
            raise ValueError(f"roles must name one of {ROLES} per instance")
        if "prefill" in self.roles and "decode" not in self.roles:
            raise ValueError("prefill instances need at least one decode instance to hand off to")
        if all(r == "decode" for r in self.roles):
            raise ValueError("a fleet of decode instances only has nowhere to prefill")
        if pd_transfer not in ("blocking", "pipelined"):
            raise ValueError(f"pd_transfer must be blocking or pipelined, got {pd_transfer!r}")
        self.pd_transfer = pd_transfer
        self.num_layers = num_layers
        self._prefill_ids = [i for i, r in enumerate(self.roles) if r == "prefill"]
        self._decode_ids = [i for i, r in enumerate(self.roles) if r == "decode"]
        self._entry_ids = [i for i, r in enumerate(self.roles) if r != "decode"]
        if migration_interval_s <= 0:
            raise ValueError("migration_interval_s must be positive")
        self.instances = list(instances)
        # A FleetController (cluster/), or a bare router (anything with `route`): routing only.
        self.controller: FleetDecisions = controller if hasattr(controller, "plan_migrations") \
            else RoutingOnly(controller)  # type: ignore[assignment]
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._waking: set[int] = set()
        self.now = 0.0
        # One live view per instance for the whole run, read at the moment of each arrival.
        self._moment = Moment()
        self._states = [instance.live_view(self._moment) for instance in self.instances]
        self.draining: set[int] = set()  # instances out of routing, to be emptied by the `drain` policy
        self.migrator: Optional[SimMigrator] = None
        self._ticks = self.controller.migration_enabled  # the control tick plans migrations
        # Mixed instances may hand a request they prefilled to another (controller.mixed_handoff).
        mixed_handoff = getattr(self.controller, "mixed_handoff", None)
        self._mixed_handoff = mixed_handoff is not None and mixed_handoff.hands_off_anything \
            and sum(r == "mixed" for r in self.roles) > 1
        self._asked: set[str] = set()  # requests the mixed hand-off policy was asked about
        if self._ticks or self._prefill_ids or self._mixed_handoff:
            if costs is None:
                raise ValueError("migration and P/D hand-off need MoveCosts (KV bytes per token, link bandwidth)")
            self.migrator = SimMigrator(self.controller, self.instances, self._states, costs, self._push_transfer,
                                        self._touch, handoff_s)
            self.migrator.draining = self.draining  # shared: a drain shows in the views the policies read
            self.migrator.prefill_ids = set(self._prefill_ids)
        self.migration_interval_s = migration_interval_s
        self._next_tick: Optional[int] = None  # index k of the pending tick at k * interval
        self.scaling: Optional[SimScaling] = None
        self.timeline: Optional[tl.FleetTimeline] = None  # set by run()
        self._held: list[Request] = []  # arrivals while no instance is ready (scaled to zero, or all starting)
        self._more_arrivals = False
        self._entry_pools = tuple(dict.fromkeys(r for r in self.roles if r != "decode"))
        if scaling is not None:
            self.scaling = SimScaling(scaling, self.roles)
            if self.migrator is not None:
                self.migrator.offline = self.scaling.offline()

    def drain_at(self, time: float, instance_id: int) -> None:
        """From `time` on, `instance_id` takes no new request and its running ones are offered to
        the controller to move off (scale-down, an operator's drain); queued ones stay."""
        if not 0 <= instance_id < len(self.instances):
            raise ValueError(f"no instance {instance_id}")
        self._push(time, DRAIN, instance_id)

    def _push(self, time: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (time, kind, next(self._seq), payload))

    def run(self, requests: Iterable[Request], on_progress: Optional[Callable[[float, int], None]] = None,
            until: Optional[float] = None,
            on_done: Optional[Callable[[Request, Optional[str]], None]] = None,
            timeline: Optional[tl.FleetTimeline] = None) -> SimResult:
        """Simulate until every request has finished (or `until` seconds of simulated time).

        `requests` must come in arrival order; they are pulled lazily, so a generator of a
        million requests never sits in memory at once. With `on_done(request, error)` each
        request is handed over when it finishes (error None) or is rejected, and not kept.
        With `timeline`, the fleet is sampled into it every `timeline.interval_s` of simulated
        time and its events recorded (requests' latencies are the caller's to add: it knows the
        SLOs); sampling only reads, so the run's decisions are the same with or without it.
        """
        run = _Run(iter(requests), on_done)
        self._run = run
        pending = next(run.arrivals, None)
        self._more_arrivals = pending is not None
        if pending is not None:
            self._push(pending.arrival_time, ARRIVAL, pending)
        if self.scaling is not None:
            self._push(self.now, SCALE, int(self.now // self.scaling.spec.interval_s))
        self.timeline = timeline
        if timeline is not None:
            if self.migrator is not None:
                self.migrator.on_moved = self._moved
            self._push(self.now, SAMPLE, int(self.now // timeline.interval_s))
        handlers: dict[int, Callable[[Any], None]] = {
            DRAIN: self._on_drain, ARRIVAL: self._on_arrival, TICK: self._tick, SCALE: self._scale,
            SAMPLE: self._sample, READY: self._on_ready, MIGRATE: self._on_migrate, WAKE: self._on_wake,
            STEP_END: self._on_step_end}
        bookkeeping = (TICK, SCALE, SAMPLE)  # a final tick that finds nothing to do does not extend the run
        events = 0
        last_work = self.now
        while self._heap:
            time, kind, _, payload = heapq.heappop(self._heap)
            if until is not None and time > until:
                break
            self.now = time
            events += 1
            if kind not in bookkeeping:
                last_work = time
            handlers[kind](payload)
            if on_progress is not None and events % 1024 == 0:
                on_progress(self.now, run.num_finished)
        finished, rejected, num_finished = run.finished, run.rejected, run.num_finished
        if on_progress is not None:
            on_progress(self.now, num_finished)
        for request in self._held:  # the run ended (`until`) before any instance was ready for them
            rejected.append((request, "no instance became ready"))
        self._held = []
        scaling = self.scaling.close(last_work).as_dict() if self.scaling is not None else {}
        energy = energy_summary([i.clock for i in self.instances], self.roles, last_work,  # type: ignore[misc]
                                self.scaling.books.pool_seconds if self.scaling is not None else None)
        return SimResult(finished, rejected, last_work, events, num_finished, [i.busy_time for i in self.instances],
                         self.controller.counters if self._ticks else {},
                         getattr(self.controller, "handoff_counters", {})
                         if self._prefill_ids or self._mixed_handoff else {},
                         scaling, energy, [i.cost_model.books.as_dict() for i in self.instances  # type: ignore[attr-defined]
                                           if getattr(i.cost_model, "prices_experts", False)],
                         [i.cost_model.books.as_dict() for i in self.instances  # type: ignore[attr-defined]
                          if getattr(i.cost_model, "prices_stages", False)])

    # ---- one method per event kind (run's dispatch table) ------------------------------
    def _on_drain(self, instance_id: int) -> None:
        self.draining.add(instance_id)
        self._event(tl.DRAIN, instance_id, "operator")
        if self._ticks and self._next_tick is None:
            self._schedule_tick(int(self.now // self.migration_interval_s) + 1)

    def _on_arrival(self, request: Request) -> None:
        run = self._run
        if request.arrival_time < run.last_arrival:
            raise ValueError(f"requests are not in arrival order at {request.request_id!r}")
        run.last_arrival = request.arrival_time
        error = self._arrive(request)
        if error is not None:
            run.reject(request, error)
        pending = next(run.arrivals, None)
        self._more_arrivals = pending is not None
        if pending is not None:
            self._push(pending.arrival_time, ARRIVAL, pending)
        if self._ticks and self._next_tick is None:
            self._schedule_tick(int(self.now // self.migration_interval_s) + 1)

    def _on_ready(self, slot: int) -> None:
        for request in self._ready(slot):
            error = self._arrive(request, observed=True)
            if error is not None:
                self._run.reject(request, error)

    def _on_migrate(self, payload) -> None:
        self.migrator.advance(payload, self.now)  # type: ignore[union-attr]

    def _on_wake(self, instance: SimInstance) -> None:
        self._waking.discard(instance.instance_id)
        if not instance.is_busy:
            self._start(instance)

    def _on_step_end(self, payload: tuple[SimInstance, float]) -> None:
        instance, end = payload
        if instance.busy_until != end:
            return  # a decode run cut short by an arrival: its old end no longer stands
        run = self._run
        for request in instance.finish_step(end):
            run.num_finished += 1
            if run.on_done is not None:
                run.on_done(request, None)
            else:
                run.finished.append(FinishedOn(request, instance.instance_id))
        if self.migrator is not None:
            self.migrator.at_step_boundary(instance, end)
            if self.roles[instance.instance_id] == "prefill":
                self._hand_off(instance)
            elif self._mixed_handoff and self.roles[instance.instance_id] == "mixed":
                self._hand_off_mixed(instance)
        self._start(instance)
        if self.scaling is not None and instance.instance_id in self.draining:
            self._stop_if_empty(instance)

    def _arrive(self, request: Request, observed: bool = False) -> Optional[str]:
        """Route and queue an arrival; returns why it was rejected, if it was. Under autoscaling,
        only ready instances are routed to; with none ready the request waits for the first."""
        self._moment.advance(self.now)
        entry = self._entry_ids
        if self.scaling is not None:
            if not observed:
                self.scaling.observe_arrival(self.now)
            entry = self.scaling.ready_ids(*self._entry_pools)
            if not entry:
                self._held.append(request)
                return None
        open_ids = [i for i in entry if i not in self.draining] if self.draining else entry
        if not open_ids:
            open_ids = entry  # everything drains: queue anyway rather than drop
        if len(open_ids) == len(self.instances):
            choice = self.controller.route(request, self._states)
        else:
            choice = open_ids[self.controller.route(request, [self._states[i] for i in open_ids])]
        instance = self.instances[choice]
        try:
            instance.add_request(request)
        except ValueError as e:  # e.g. longer than the context window: the server would answer 400
            return str(e)
        self._touch(instance)
        return None

    def _touch(self, instance: SimInstance) -> None:
        """Its schedule may have changed at `now`: wake it if idle, else end a fast-forwarded
        run with the step in flight (the next step is planned afresh, as stepping one at a
        time would)."""
        if not instance.is_busy:
            if instance.instance_id not in self._waking:
                self._waking.add(instance.instance_id)
                self._push(self.now, WAKE, instance)
        else:
            new_end = instance.interrupt(self.now)
            if new_end is not None:
                self._push(new_end, STEP_END, (instance, new_end))

    # ---- prefill/decode hand-off -------------------------------------------------------------
    def _hand_off(self, instance: SimInstance) -> None:
        """Between two steps of a prefill instance: every request that has its first token (and
        is not already leaving) goes to the decode instance the controller picks. One that finds
        no room decodes here meanwhile and is offered again at the next step boundary."""
        migrator = self.migrator
        ready = self._decoding(instance)
        if not ready:
            return
        decode_ids = self._decode_ids
        if self.scaling is not None:  # ready and not draining; with none, it decodes here meanwhile
            decode_ids = [i for i in self.scaling.ready_ids("decode") if i not in self.draining]
            if not decode_ids:
                return
        self._moment.advance(self.now)
        decode_states = [self._states[i] for i in decode_ids]
        for request in ready:
            target = self.instances[decode_ids[self.controller.route_decode(request, decode_states)]]
            overlap = 0.0
            if self.pd_transfer == "pipelined" and request.first_scheduled_time is not None:
                overlap = self.now - request.first_scheduled_time
            migrator.handoff(request, instance, target, self.now, overlap, self.num_layers)  # type: ignore[union-attr]

    def _decoding(self, instance: SimInstance, first_token_only: bool = False) -> list[Request]:
        """`instance`'s requests in their decode phase (prompt computed, a token to feed back)
        that are not already leaving; with `first_token_only`, those that have just one token."""
        leaving = self.migrator.transfers  # type: ignore[union-attr]
        return [r for r in instance.scheduler.running if r.request_id not in leaving and r.output_token_ids
                and r.num_prompt_tokens + len(r.output_token_ids) - r.num_computed_tokens == 1
                and (len(r.output_token_ids) == 1 or not first_token_only)]

    def _hand_off_mixed(self, instance: SimInstance) -> None:
        """Between two steps of a mixed instance: each request that has just got its first token
        goes to decode on another mixed instance when the controller's mixed hand-off policy says
        it pays (asked once: at the next boundary it has two tokens). One the target has no
        room for stays."""
        ready = [r for r in self._decoding(instance, first_token_only=True) if r.request_id not in self._asked]
        if not ready:
            return
        self._asked.update(r.request_id for r in ready)  # once, where it was prefilled (not again on its target)
        others = [i for i, r in enumerate(self.roles) if r == "mixed" and i != instance.instance_id
                  and i not in self.draining and i not in self.migrator.offline]  # type: ignore[union-attr]
        if not others:
            return
        self._moment.advance(self.now)
        states = [self._states[i] for i in others]
        source = self._states[instance.instance_id]
        for request in ready:
            k = self.controller.route_mixed_handoff(request, source, states)  # type: ignore[attr-defined]
            if k is None:
                continue
            overlap = 0.0
            if self.pd_transfer == "pipelined" and request.first_scheduled_time is not None:
                overlap = self.now - request.first_scheduled_time
            self.migrator.handoff(request, instance, self.instances[others[k]], self.now, overlap,  # type: ignore
                                  self.num_layers)

    # ---- migration ------------------------------------------------------------------------
    def _schedule_tick(self, k: int) -> None:
        """Ticks fall on multiples of the interval (not on `now` + interval), so their times do
        not depend on which events happened to start them."""
        self._next_tick = k
        self._push(k * self.migration_interval_s, TICK, k)

    def _tick(self, k: int) -> None:
        self._next_tick = None
        self._moment.advance(self.now)
        self.migrator.tick(self.now)  # type: ignore[union-attr]
        if self.migrator.busy or any(i.scheduler.has_unfinished() for i in self.instances):  # type: ignore[union-attr]
            self._schedule_tick(k + 1)

    # ---- autoscaling ----------------------------------------------------------------------
    def _scale(self, k: int) -> None:
        """A decision point of the controller's scale planner; the next one while work remains."""
        scaling = self.scaling
        assert scaling is not None
        self._moment.advance(self.now)
        for i in list(self.draining):
            self._stop_if_empty(self.instances[i])
        targets = {}
        for pool in scaling.pools:  # a disaggregated fleet's pools are planned apart
            held = len(self._held) if pool in self._entry_pools else 0
            plan = self.controller.plan_scaling(scaling.signals(self.now, self._states, held, pool),
                                                scaling.slots(self._states, pool))
            targets[pool] = scaling.count(SLOT_READY, pool) + scaling.count(STARTING, pool)
            if plan is not None:
                targets[pool] = plan.target
                self._carry_out(plan, pool)
        scaling.record(self.now, targets)
        busy = self._held or any(i.scheduler.has_unfinished() for i in self.instances) or scaling.ready_at \
            or (self.migrator is not None and self.migrator.busy)
        if self._more_arrivals or busy:
            self._push((k + 1) * scaling.spec.interval_s, SCALE, k + 1)

    def _carry_out(self, plan, pool: str) -> None:
        scaling = self.scaling
        assert scaling is not None
        if plan.changes:
            who = f"{pool} " if scaling.disaggregated else ""
            self._event(tl.SCALE, None, f"{who}target {plan.target}: {plan.decision.reason}")
        for slot, ready_at in scaling.apply(plan, self.now, pool):
            self._push(ready_at, READY, slot)
            self._event(tl.START, slot, f"cold start, ready in {ready_at - self.now:.0f} s")
        for i in plan.cancel:
            self._event(tl.STOP, i, "cancelled while starting")
        for i in plan.undrain:
            self.draining.discard(i)
            self._event(tl.UNDRAIN, i, "taken back (scale up)")
        for i in plan.drain:
            self.draining.add(i)
            self._event(tl.DRAIN, i, "scale down")
            self._stop_if_empty(self.instances[i])
        if plan.drain and self._ticks and self._next_tick is None:
            self._schedule_tick(int(self.now // self.migration_interval_s) + 1)
        self._sync_offline()

    def _ready(self, slot: int) -> list[Request]:
        """An instance finished its cold start: the requests held for want of one go to the fleet."""
        assert self.scaling is not None
        if not self.scaling.became_ready(slot, self.now):
            return []
        self._event(tl.INSTANCE_READY, slot, "cold start done")
        self._sync_offline()
        if self.roles[slot] == "decode":
            return []  # held requests wait for an instance that takes arrivals
        held, self._held = self._held, []
        return held

    def _stop_if_empty(self, instance: SimInstance) -> None:
        assert self.scaling is not None
        i = instance.instance_id
        moving = self.migrator is not None and any(
            t.source is instance or t.target is instance for t in self.migrator.transfers.values())
        if self.scaling.stop_if_empty(i, self.now, not instance.scheduler.has_unfinished() and not moving):
            self._event(tl.STOP, i, "drained (scale down)")
            self.draining.discard(i)
            self._sync_offline()

    def _sync_offline(self) -> None:
        if self.migrator is not None and self.scaling is not None:
            self.migrator.offline = self.scaling.offline()

    # ---- the fleet timeline ---------------------------------------------------------------
    def _sample(self, k: int) -> None:
        """A frame of every instance at `now`; the next one while anything remains to happen."""
        timeline = self.timeline
        assert timeline is not None
        status = self.scaling.status if self.scaling is not None else None
        readings = []
        for instance in self.instances:
            i = instance.instance_id
            instance.sync(self.now)  # the decode steps done by now (what a reader sees; changes no decision)
            shown = status[i] if status is not None else (tl.DRAINING if i in self.draining else tl.READY)
            readings.append(tl.read_instance(i, instance.scheduler, instance.kv, self.roles[i], shown))
        timeline.sample(self.now, readings)
        busy = self._held or any(i.scheduler.has_unfinished() for i in self.instances) \
            or (self.migrator is not None and self.migrator.busy) or (self.scaling is not None and self.scaling.ready_at)
        if self._more_arrivals or busy:
            self._push((k + 1) * timeline.interval_s, SAMPLE, k + 1)

    def _event(self, kind: str, instance: Optional[int], detail: str) -> None:
        if self.timeline is not None:
            self.timeline.event(self.now, kind, instance, detail)

    def _moved(self, move, ok: bool, now: float, sent: int, downtime_s: float) -> None:
        if move.reason != HANDOFF:  # hand-offs are every request's: counted, not listed
            self._event(tl.MIGRATION, move.source, f"{move.request_id} to instance {move.target} ({move.reason}): "
                        + (f"{sent} bytes, {downtime_s * 1e3:.0f} ms down" if ok else "aborted"))

    def _push_transfer(self, time: float, transfer: Transfer) -> None:
        self._push(time, MIGRATE, transfer)

    def _start(self, instance: SimInstance) -> None:
        end = instance.start_step(self.now)
        if end is not None:
            self._push(end, STEP_END, (instance, end))
