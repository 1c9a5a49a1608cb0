"""Several services (models) on one simulated fleet, each its own pool, at flow level.

Each service is a fluid fleet (sim/fluid.py) with its own demand, response curve, controller and
lifecycle books; they are stepped together, one tick at a time. Without a budget each pool
scales on its own. With a GPU budget (instances of all pools together), every decision round
asks each pool's planner what it wants (`ScalePlanner.decide`), shares the budget by marginal
value (cluster/autoscale/budget.share_budget: each pool's worth is the requests/s its curve
expects within the SLO at the demand it last observed) and has each pool plan to its grant
(`ScalePlanner.plan_to`). A pool granted fewer than it runs drains them at once (the budget,
not its demand, took them); an instance another pool is granted starts only once the budget has
room for it (draining ones hold their devices until they stop), so the pools never hold more
than the budget together."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from sloserve.cluster.autoscale.budget import ServiceAsk, share_budget
from sloserve.fleet_view import DRAINING, READY, STARTING
from sloserve.sim.fluid import FluidFleet, FluidResult


@dataclass
class ServicesResult:
    services: dict[str, FluidResult]
    budget: Optional[int]

    @property
    def instance_hours(self) -> float:
        return sum(r.scaling["instance_hours"] for r in self.services.values())

    @property
    def attainment(self) -> float:
        """Of every service's requests together, the share expected within its SLO."""
        requests = sum(r.requests for r in self.services.values())
        return sum(r.met for r in self.services.values()) / requests if requests else 1.0

    def as_dict(self) -> dict:
        return {"budget": self.budget, "instance_hours": self.instance_hours, "attainment": self.attainment,
                "services": {name: {"requests": r.requests, "met": r.met, "attainment": r.attainment,
                                    "unserved": r.unserved, "instance_hours": r.scaling["instance_hours"],
                                    "cold_starts": r.scaling["cold_starts"]}
                             for name, r in self.services.items()}}


class ServiceFleets:
    def __init__(self, fleets: Mapping[str, FluidFleet], budget: Optional[int] = None) -> None:
        """`fleets`: each service's fluid fleet (its controller must have one `mixed` planner);
        `budget`: the most instances all pools may run together (None: no limit)."""
        if not fleets:
            raise ValueError("need at least one service")
        ticks = {(f.tick_s, f.scaling.spec.interval_s) for f in fleets.values()}
        if len(ticks) != 1:
            raise ValueError("the services' fleets must share one tick and one decision interval")
        if budget is not None:
            floor = sum(self._planner(f).min_instances for f in fleets.values())
            if budget < floor:
                raise ValueError(f"a budget of {budget} instances is below the services' minimums ({floor})")
        self.fleets = dict(fleets)
        self.budget = budget

    @staticmethod
    def _planner(fleet: FluidFleet):
        try:
            return fleet.controller.scalers["mixed"]
        except (AttributeError, KeyError):
            raise ValueError("each service's controller needs an autoscaling planner") from None

    def run(self, rates: Mapping[str, Sequence[float]], step_s: float) -> ServicesResult:
        """Each service's demand (`rates[name][k]` requests/s during [k step_s, (k+1) step_s)),
        stepped together until every service's last window ends and its backlog drains."""
        missing = sorted(set(self.fleets) - set(rates))
        if missing:
            raise ValueError(f"no demand for service(s) {', '.join(missing)}")
        flows = {name: fleet.flow(rates[name], step_s) for name, fleet in self.fleets.items()}
        while not all(flow.done for flow in flows.values()):
            rounds = {name: flow.begin() for name, flow in flows.items() if not flow.done}
            deciding = [name for name, (_, _, decide) in rounds.items() if decide]
            if self.budget is None:
                for name in deciding:
                    self.fleets[name]._decide(rounds[name][0], flows[name].queued, rounds[name][1])
            elif deciding:
                self._share(deciding, {n: (rounds[n][0], flows[n].queued, rounds[n][1]) for n in deciding})
            for name in rounds:
                flows[name].serve()
        return ServicesResult({name: flow.result() for name, flow in flows.items()}, self.budget)

    def _share(self, names: list[str], state: dict[str, tuple[float, float, float]]) -> None:
        """One decision round of the pools in `names` under the budget."""
        asks, seen = [], {}
        for name in names:
            fleet, (now, queued, rate) = self.fleets[name], state[name]
            signals, slots = fleet.observe(now, queued, rate)
            planner = self._planner(fleet)
            decision, wanted = planner.decide(signals)
            observed = signals.demand[-1] if signals.demand else rate  # the rate the controller has seen
            asks.append(ServiceAsk(name, planner.min_instances, wanted,
                                   lambda n, f=fleet, r=observed: f.served_within_slo(r, n),
                                   held=fleet.scaling.count(READY) + fleet.scaling.count(STARTING)))
            seen[name] = (now, signals, slots, decision, planner)
        draining = sum(f.scaling.count(DRAINING) for f in self.fleets.values())
        others = sum(f.scaling.count(READY) + f.scaling.count(STARTING) for n, f in self.fleets.items()
                     if n not in seen)
        available = self.budget - others - draining  # type: ignore[operator]
        grants = share_budget(asks, max(available, sum(a.fewest for a in asks)))
        binding = sum(max(a.fewest, a.wanted) for a in asks) > available
        # shrink first, so the instances they give up make room for the pools that grow
        order = sorted(names, key=lambda n: grants[n] - self._active(self.fleets[n]))
        for name in order:
            now, signals, slots, decision, planner = seen[name]
            fleet = self.fleets[name]
            used = sum(self._active(f) for n, f in self.fleets.items() if n != name)
            grant = min(grants[name], max(planner.min_instances, self.budget - used))  # type: ignore[operator]
            # while the budget binds, a pool gives up what it was not granted at once (others wait for it)
            fleet.carry_out(planner.plan_to(decision, grant, signals, slots, now=binding), now)

    @staticmethod
    def _active(fleet: FluidFleet) -> int:
        """Instances a pool holds against the budget: ready, starting and draining (each holds a
        device until it stops)."""
        return fleet.scaling.count(READY) + fleet.scaling.count(STARTING) + fleet.scaling.count(DRAINING)


__all__ = ["ServiceFleets", "ServicesResult"]
