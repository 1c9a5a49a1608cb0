"""Several models' pools on one budget of workers (`serve --models FILE` with `budget: N`).

Each model's autoscaler keeps its own policy and planner; instead of each deciding alone, one
loop asks every pool's planner what it wants (`ScalePlanner.decide`), shares the budget as the
simulator does (cluster/autoscale/budget.share_budget: keep what each holds up to its want, spare
workers by marginal value, a move between models only for a clear gain), and has every pool plan
to its grant (`ScalePlanner.plan_to`). A pool's worth of n workers is the requests/s it would serve:
min(the demand it last observed, n x its capacity). While the budget binds, a pool gives up what
it was not granted at once; a pool that grows starts workers only as the budget has room (draining
workers hold theirs until they stop), so the models never hold more than the budget together."""
from __future__ import annotations

import contextlib
import asyncio
from typing import TYPE_CHECKING, Optional

from sloserve.cluster.autoscale.budget import ServiceAsk, share_budget
from sloserve.fleet_view import DRAINING, READY, STARTING
from sloserve.front.migration import every

if TYPE_CHECKING:
    from sloserve.front.autoscale import AutoscaleDriver


class ModelsBudget:
    def __init__(self, drivers: dict[str, "AutoscaleDriver"], budget: int, interval_s: float) -> None:
        if any(d.pools != ["mixed"] for d in drivers.values()):
            raise ValueError("a budget shared by several models takes colocated pools (no --pd)")
        floor = sum(d.fleet.controller.scalers["mixed"].min_instances for d in drivers.values())
        if budget < floor:
            raise ValueError(f"a budget of {budget} workers is below the models' minimums ({floor})")
        self.drivers = dict(drivers)
        self.budget = budget
        self.interval_s = interval_s
        self._task: Optional[asyncio.Task] = None
        for driver in self.drivers.values():
            driver.budget = self

    def held(self, driver: "AutoscaleDriver", *statuses: str) -> int:
        return sum(driver.status_of(i) in statuses for i in driver.fleet.instances)

    def tick(self) -> None:
        """One round for every model that has a worker up (one that has none yet plans nothing)."""
        ready = {n: d for n, d in self.drivers.items() if d.ready_to_plan()}
        draining = sum(self.held(d, DRAINING) for d in self.drivers.values())
        others = sum(self.held(d, READY, STARTING) for n, d in self.drivers.items() if n not in ready)
        asks, seen = [], {}
        for name, driver in ready.items():
            signals, slots = driver.signals(), driver.slots()
            planner = driver.fleet.controller.scalers["mixed"]
            decision, wanted = planner.decide(signals)
            demand = signals.demand[-1] if signals.demand else 0.0
            if signals.held:  # requests waiting for a worker: demand now, whatever the last window said
                demand = max(demand, float(signals.held))
            asks.append(ServiceAsk(name, planner.min_instances, wanted,
                                   lambda n, r=demand, c=signals.capacity_rps: min(r, n * c),
                                   held=self.held(driver, READY, STARTING)))
            seen[name] = (driver, planner, decision, signals, slots)
        if not asks:
            return
        available = self.budget - others - draining
        grants = share_budget(asks, max(available, sum(a.fewest for a in asks)))
        binding = sum(max(a.fewest, a.wanted) for a in asks) > available
        for name in sorted(seen, key=lambda n: grants[n] - self.held(seen[n][0], READY, STARTING)):  # shrink first
            driver, planner, decision, signals, slots = seen[name]
            used = sum(self.held(d, READY, STARTING, DRAINING) for n, d in self.drivers.items() if n != name)
            grant = min(grants[name], max(planner.min_instances, self.budget - used))
            driver.carry_out(planner.plan_to(decision, grant, signals, slots, now=binding))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(every(self.interval_s, self.tick, "budget"))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def describe(self) -> dict:
        return {"budget": self.budget, "held": {n: self.held(d, READY, STARTING, DRAINING)
                                                for n, d in self.drivers.items()}}
