"""Autoscaling the real fleet (`sloserve serve --instances MIN:MAX --autoscale POLICY`).

Every `interval_s` the driver shows the fleet controller what the front sees: workers ready
(healthy, not draining), starting and draining, their last load reports, the request rate the front
admitted per `demand_step_s` window (the simulator's `DemandMeter`), what one worker sustains
(`--capacity`) and how long a worker takes to start: measured on this fleet's own workers (spawn to
first healthy poll), the configured guess until one has started. The controller's scale planner
answers (the same policies and rules as in the simulator), and the driver carries it out through the
same `cluster/autoscale/execute.apply_plan` the simulator uses: a stopped slot gets a worker, a
draining one is taken back, a starting one is stopped, a ready one drains: it leaves routing, the
`drain` migration policy moves its relayed streams off, and once nothing runs there its worker is
stopped. Each decision is logged with its reason and kept for /v1/instances.

A `--pd` fleet scales its two pools apart: each has its own planner in the controller and its
own capacity per worker (`--pd-capacity`), and sees only its own workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from sloserve.cluster.autoscale.demand import DemandMeter
from sloserve.cluster.autoscale.execute import apply_plan
from sloserve.fleet_view import DRAINING, READY, STARTING, STOPPED, InstanceSlot, ScalingPlan, ScalingSignals
from sloserve.front.migration import every
from sloserve.timeline import DRAIN, SCALE, UNDRAIN
from sloserve.workers.fleet import HEALTHY, STARTING as FLEET_STARTING, STOPPED as FLEET_STOPPED

if TYPE_CHECKING:
    from sloserve.workers.fleet import Instance, WorkerFleet  # noqa: F401

logger = logging.getLogger(__name__)


class SharedBudget(Protocol):
    def tick(self) -> None:
        """One round for every pool that shares the budget."""


class AutoscaleDriver:
    def __init__(self, fleet: "WorkerFleet", capacity_rps: "float | dict[str, float]", interval_s: float = 10.0,
                 demand_step_s: float = 10.0, cold_start_guess_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_drain: Optional[Callable[[], object]] = None) -> None:
        """`capacity_rps`: req/s one worker sustains, or per pool ({"prefill": .., "decode": ..}).
        `on_drain`: run when workers start draining (the front's migration round: their streams
        start moving at once, not at the migration loop's next interval)."""
        capacity = capacity_rps if isinstance(capacity_rps, dict) else {"mixed": capacity_rps}
        if not all(c > 0 for c in capacity.values()) or not interval_s > 0 or not demand_step_s > 0:
            raise ValueError("autoscaling needs capacity > 0 req/s, interval > 0 s and demand step > 0 s")
        self.fleet = fleet
        self.capacity = capacity
        self.pools = list(capacity)  # "mixed", or "prefill" and "decode"
        self.interval_s = interval_s
        self.demand_step_s = demand_step_s
        self.cold_start_guess_s = cold_start_guess_s
        self.clock = clock
        self.on_drain = on_drain
        self.started_at = clock()
        self.demand = DemandMeter(demand_step_s)
        self.targets: dict[str, int] = {}
        self.held = 0  # requests the front holds because no worker takes arrivals (scaled to zero)
        self.decisions: list[dict] = []  # the latest 50 changes: time, target, reason
        self.budget: Optional[SharedBudget] = None  # front/budget.ModelsBudget, when several models share one
        self.counters = {"starts": 0, "cancelled": 0, "drains": 0, "stops": 0, "taken_back": 0}
        self._task: Optional[asyncio.Task] = None

    # ---- what the front reports ------------------------------------------------------
    def observe_arrival(self) -> None:
        self.demand.observe(self.clock() - self.started_at)

    # ---- the loop ----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None and self.budget is None:  # under a budget, its loop decides
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        await every(self.interval_s, self.tick, "autoscaling")

    async def hold(self, ready: Callable[[], bool], stop, timeout_s: float) -> bool:
        """Hold a request while no worker takes arrivals (the fleet scaled to zero, or all its
        arrival workers draining or starting): the policy sees it as queued and is asked at once,
        not at its next interval. True once `ready()`; False after `timeout_s`. `stop` (the
        request's front.stream.Stop) ends the wait when the client leaves."""
        deadline = self.clock() + timeout_s
        self.held += 1
        try:
            self.tick()
            while not ready():
                if self.clock() > deadline:
                    return False
                await stop.run(asyncio.sleep(0.05))
            return True
        finally:
            self.held -= 1

    def ready_in_s(self) -> float:
        """Seconds until a worker that takes arrivals is expected to serve: the soonest of those
        starting (each at this fleet's measured start time), or a whole start if none is."""
        start_s = self.fleet.measured_start_s(self.cold_start_guess_s)
        now = self.clock()
        starting = [max(0.0, i.started_at + start_s - now) for i in self.fleet.instances
                    if i.role != "decode" and self.status_of(i) == STARTING and i.status == FLEET_STARTING]
        return min(starting) if starting else start_s

    def wake(self) -> None:
        """A request found no worker and will not wait (its TTFT target is shorter than a start):
        the planner sees it as queued now, so a worker starts for the requests that follow."""
        self.held += 1
        try:
            self.tick()
        finally:
            self.held -= 1

    def status_of(self, inst: "Instance") -> str:
        if inst.status == FLEET_STOPPED:
            return STOPPED
        if inst.status == FLEET_STARTING:
            return STARTING
        if inst.draining:
            return DRAINING
        return READY if inst.status == HEALTHY else STARTING  # unresponsive or dead-and-replacing: not serving

    @property
    def target(self) -> Optional[int]:
        """Workers wanted, over every pool (None before the first decision)."""
        return sum(self.targets.values()) if self.targets else None

    def _pool(self, pool: str) -> list["Instance"]:
        return [i for i in self.fleet.instances if pool == "mixed" or i.role == pool]

    def signals(self, pool: str = "mixed") -> ScalingSignals:
        now = self.clock()
        mine = self._pool(pool)
        statuses = [self.status_of(i) for i in mine]
        ready = [i for i, s in zip(mine, statuses) if s == READY]
        return ScalingSignals(now - self.started_at, len(ready), statuses.count(STARTING), statuses.count(DRAINING),
                              [i.routing_state(self.fleet.block_size) for i in ready],
                              self.demand.rates(now - self.started_at), self.demand_step_s, self.capacity[pool],
                              self.fleet.measured_start_s(self.cold_start_guess_s),
                              held=self.held if pool != "decode" else 0, pool=pool)

    def slots(self, pool: str = "mixed") -> list[InstanceSlot]:
        out = []
        for inst in self._pool(pool):
            s = inst.state
            work = 0.0 if s is None else s.predicted_remaining_decode_tokens + s.queued_prefill_tokens
            out.append(InstanceSlot(inst.slot, self.status_of(inst), work + 1000.0 * inst.in_flight))
        return out

    def tick(self) -> None:
        if self.budget is not None:  # several models share one budget: it decides for all of them
            self.budget.tick()
            return
        if not self.ready_to_plan():
            return
        for pool in self.pools:
            self.carry_out(self.fleet.controller.plan_scaling(self.signals(pool), self.slots(pool)), pool)

    def ready_to_plan(self) -> bool:
        """Stop the drained workers that emptied; False while no worker has come up yet (the model
        is unproven and its cold start unmeasured: nothing to plan with)."""
        if not self.fleet.start_times:
            return False
        for inst in self.fleet.instances:
            if inst.draining and self.status_of(inst) == DRAINING and self._empty(inst):
                self.fleet.stop_slot(inst, "drained (scale down)")
                self.counters["stops"] += 1
        return True

    def carry_out(self, plan: Optional[ScalingPlan], pool: str = "mixed") -> None:
        if plan is None:
            return
        self.targets[pool] = plan.target
        who = "" if pool == "mixed" else f"{pool} "
        if plan.changes:
            self.fleet.on_event(SCALE, None, f"{who}target {plan.target}: {plan.decision.reason}")
        apply_plan(plan, _FrontPort(self), pool)
        if plan.drain and self.on_drain is not None:
            self.on_drain()
        if plan.changes:
            decision = {"t": round(self.clock() - self.started_at, 1), "target": plan.target,
                        "reason": plan.decision.reason}
            if pool != "mixed":
                decision["pool"] = pool
            self.decisions = (self.decisions + [decision])[-50:]
            logger.warning("autoscale: %starget %d instances (%s): start %d, take back %s, cancel %s, drain %s",
                           who, plan.target, plan.decision.reason, plan.start, list(plan.undrain), list(plan.cancel),
                           list(plan.drain))

    @staticmethod
    def _empty(inst: "Instance") -> bool:
        s = inst.state
        return inst.in_flight == 0 and s is not None and s.num_running == 0 and s.num_waiting == 0

    def describe(self) -> dict:
        statuses = [self.status_of(i) for i in self.fleet.instances]
        return {"target": self.target, "ready": statuses.count(READY), "starting": statuses.count(STARTING),
                "draining": statuses.count(DRAINING), "stopped": statuses.count(STOPPED),
                "capacity_rps": self.capacity.get("mixed"),
                **({"pools": {pool: {"target": self.targets.get(pool), "capacity_rps": self.capacity[pool],
                                     "ready": sum(self.status_of(i) == READY for i in self._pool(pool)),
                                     "min": low, "max": len(self._pool(pool))}
                              for pool, (low, _) in self.fleet.config.fleet.pool_bounds.items()}}
                   if self.pools != ["mixed"] else {}),
                "measured_start_s": round(self.fleet.measured_start_s(float("nan")), 2) if self.fleet.start_times
                else None, **self.counters, "decisions": self.decisions}


class _FrontPort:
    """The real fleet as a scaling port (cluster/autoscale/execute.py)."""

    def __init__(self, driver: AutoscaleDriver) -> None:
        self.driver = driver
        self.fleet = driver.fleet
        self.by_slot = {i.slot: i for i in driver.fleet.instances}

    def undrain(self, slot: int) -> None:
        self.by_slot[slot].draining = False
        self.driver.counters["taken_back"] += 1
        self.fleet.on_event(UNDRAIN, slot, "taken back (scale up)")

    def cancel(self, slot: int) -> None:
        self.fleet.stop_slot(self.by_slot[slot], "cancelled while starting (scale down)")
        self.driver.counters["cancelled"] += 1

    def drain(self, slot: int) -> None:
        inst = self.by_slot[slot]
        inst.draining = True
        self.driver.counters["drains"] += 1
        self.fleet.on_event(DRAIN, slot, f"scale down, {inst.in_flight} in flight")

    def stopped(self, pool: str) -> list[int]:
        return [i.slot for i in self.driver._pool(pool) if i.status == FLEET_STOPPED]

    def start(self, slot: int) -> None:
        self.fleet.start_slot(self.by_slot[slot])
        self.driver.counters["starts"] += 1
