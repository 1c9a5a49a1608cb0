"""A fleet at flow level: days of demand on tens of instances, through the same controller.

The discrete-event simulator steps every request through the real scheduler; a day of
ServeGen-shaped demand on 32-64 H100s serving an 8B model is tens of millions of requests,
hours of wall time per policy. What an autoscaler decides depends on the demand it observes,
the instances it has and the queue that builds when they are too few, not on each request. So
here demand moves as a flow, tick by tick, through the same scale planners (the controller's
`plan_scaling`) and the same instance lifecycle books (`SimScaling`: cold and warm starts,
draining, instance-seconds), and what requests get is priced by a `ResponseCurve` the
discrete-event simulator measured on the same workload and fleet settings (planning.response_curve):
the share of requests within the SLO at a given load per ready instance.

Each tick (1 s by default):
- arrivals flow at the demand's rate; the scaling books observe a Poisson count of them, as the
  discrete fleet observes each arrival (the autoscaler sees the noise of a real count; the flow
  does not carry it, since the curve measured at a load already includes its Poisson bursts);
- the ready instances serve up to their saturation rate (the curve's throughput); arrivals past
  it join a first-come-first-served backlog (with no ready instance all of them do: requests
  held while the fleet scales from zero), which drains at the spare rate;
- requests served meet the SLO with the curve's attainment at the load (arrival rate over the
  capacity of the ready instances, at most the saturation load: past it the backlog prices the
  excess), when they waited in the backlog less than the TTFT target; the ones that waited longer
  miss it;
- a draining instance stops after `drain_s` (its requests migrate off, `migration=drain`).
Not modelled: per-request detail (no records: only counts), imbalance between instances beyond
what the curve's calibration fleet had, KV state carried by migrations, P/D pools.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from sloserve.fleet_view import DRAINING, READY, STARTING, InstanceSlot, ScalingPlan, ScalingSignals
from sloserve.sched.state import InstanceState
from sloserve.sim.scaling import SimScaling


@dataclass(frozen=True)
class ResponseCurve:
    """SLO attainment of the requests an instance serves, by its load (arrival rate over the
    capacity model's rate), and the rate it completes requests at when overloaded."""

    loads: tuple[float, ...]  # increasing
    attainment: tuple[float, ...]  # at each load, made non-increasing
    saturation_rps: float  # requests/s one instance completes past its capacity
    capacity_rps: float  # the capacity model's rate, load 1.0
    waiting: tuple[float, ...] = ()  # requests queued in an instance at each load (none if not measured)

    def __post_init__(self) -> None:
        if len(self.loads) != len(self.attainment) or not self.loads:
            raise ValueError("a response curve needs one attainment per load, and at least one load")
        if self.waiting and len(self.waiting) != len(self.loads):
            raise ValueError("a response curve needs one queue length per load, or none")
        if list(self.loads) != sorted(set(self.loads)) or self.loads[0] < 0:
            raise ValueError(f"loads must be increasing and >= 0, got {self.loads}")
        if not self.saturation_rps > 0 or not self.capacity_rps > 0:
            raise ValueError("saturation and capacity rates must be > 0")
        # more load never helps: a noisy measurement that rises is held at the level before it
        object.__setattr__(self, "attainment", tuple(np.minimum.accumulate(np.clip(self.attainment, 0.0, 1.0))))

    def at(self, load: float) -> float:
        """Attainment at `load`, interpolated; past the last load measured, the requests beyond that
        load are counted as misses (an overloaded instance serves no more within the SLO)."""
        last = self.loads[-1]
        if load <= last:
            return float(np.interp(load, self.loads, self.attainment))
        return self.attainment[-1] * last / load

    def waiting_at(self, load: float) -> float:
        """Requests queued in an instance at `load` (an autoscaler's `queued` counts them)."""
        if not self.waiting:
            return 0.0
        return float(np.interp(min(load, self.saturation_load), self.loads, self.waiting))

    @property
    def saturation_load(self) -> float:
        """The load past which a queue grows without bound. The curve is priced up to it; beyond it
        the fleet's backlog accounts for the excess (the curve's own points there measured a queue
        growing for their whole window, which the backlog would count a second time)."""
        return self.saturation_rps / self.capacity_rps

    def as_dict(self) -> dict:
        return {"loads": list(self.loads), "attainment": list(self.attainment), "waiting": list(self.waiting),
                "saturation_rps": self.saturation_rps, "capacity_rps": self.capacity_rps}


@dataclass
class FluidResult:
    requests: float  # arrivals (the flow's)
    met: float  # of them, expected to meet the SLO
    unserved: float  # still in the backlog at the end
    scaling: dict  # ScalingBooks.as_dict()
    windows: list = field(default_factory=list)  # (start s, arrivals, met) per rate window

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0


def _idle_state(waiting: int) -> InstanceState:
    """What a ready instance shows the autoscaler: only its share of the queue is known at flow level."""
    return InstanceState(num_running=0, num_waiting=waiting, queued_prefill_tokens=0, kv_blocks_used=0,
                         kv_blocks_free=0, kv_blocks_total=0, predicted_remaining_decode_tokens=0,
                         prefix_cache_hit_rate=0.0, min_ttft_slack_s=math.inf)


class FluidFleet:
    def __init__(self, controller: Any, scaling: SimScaling, curve: ResponseCurve, ttft_s: float,
                 tick_s: float = 1.0, drain_s: float = 10.0, seed: int = 0) -> None:
        """`controller`: anything with `plan_scaling(signals, slots)` (a FleetController). A mixed
        fleet only: P/D pools scale on their own signals, which a single flow does not give."""
        if scaling.disaggregated:
            raise ValueError("the fluid fleet models a colocated fleet; P/D pools need the discrete simulator")
        if not tick_s > 0 or drain_s < 0 or not ttft_s > 0:
            raise ValueError("need tick > 0, drain >= 0 and a TTFT target > 0")
        if scaling.spec.interval_s % tick_s or scaling.spec.demand_step_s % tick_s:
            raise ValueError("the decision interval and demand step must be whole numbers of ticks")
        self.controller = controller
        self.scaling = scaling
        self.curve = curve
        self.ttft_s = ttft_s
        self.tick_s = tick_s
        self.drain_s = drain_s
        self.rng = np.random.default_rng(seed)
        self._draining_since: dict[int, float] = {}

    def run(self, rates: Sequence[float], step_s: float) -> FluidResult:
        """Demand of `rates[k]` requests/s during [k step_s, (k+1) step_s); runs until the last
        window ends and the backlog has drained (or an hour past it)."""
        flow = self.flow(rates, step_s)
        while not flow.done:
            now, rate, deciding = flow.begin()
            if deciding:
                self._decide(now, flow.queued, rate)
            flow.serve()
        return flow.result()

    def flow(self, rates: Sequence[float], step_s: float) -> "Flow":
        """A run of `rates` to step through tick by tick (`run` does; sim/services.py steps several
        fleets' flows together)."""
        return Flow(self, rates, step_s)

    def _lifecycle(self, now: float) -> None:
        """Cold starts that end by `now`, and draining instances that have emptied."""
        scaling = self.scaling
        for slot, at in sorted(scaling.ready_at.items()):
            if at <= now:
                scaling.became_ready(slot, at)
        for i, status in enumerate(scaling.status):
            if status == DRAINING:
                since = self._draining_since.setdefault(i, now)
                if now - since >= self.drain_s and scaling.stop_if_empty(i, now, True):
                    del self._draining_since[i]
            else:
                self._draining_since.pop(i, None)

    def _decide(self, now: float, queued: float, rate: float) -> None:
        """A decision of the controller's scale planner."""
        signals, slots = self.observe(now, queued, rate)
        self.carry_out(self.controller.plan_scaling(signals, slots), now)

    def observe(self, now: float, queued: float, rate: float) -> tuple[ScalingSignals, list[InstanceSlot]]:
        """What the scale planner sees at `now`: ready instances show the queue a discrete instance
        would have at this load (the curve's) plus their share of the backlog."""
        scaling = self.scaling
        ready = scaling.ready_ids()
        held = round(queued) if not ready else 0
        inside = self.curve.waiting_at(rate / (len(ready) * self.curve.capacity_rps)) if ready else 0.0
        share = round(queued / len(ready) + inside) if ready else 0
        states = [_idle_state(share if s == READY else 0) for s in scaling.status]
        return scaling.signals(now, states, held), scaling.slots(states)

    def carry_out(self, plan: Optional[ScalingPlan], now: float) -> None:
        scaling = self.scaling
        target = scaling.count(READY) + scaling.count(STARTING)
        if plan is not None:
            target = plan.target
            scaling.apply(plan, now)
        scaling.record(now, {"mixed": target})

    def served_within_slo(self, rate: float, instances: int) -> float:
        """Requests/s expected within the SLO at `rate` on `instances` ready instances (the curve's
        attainment on what they can complete): what one more instance is worth to this fleet."""
        if instances <= 0 or rate <= 0:
            return 0.0
        curve = self.curve
        load = min(rate / (instances * curve.capacity_rps), curve.saturation_load)
        return min(rate, instances * curve.saturation_rps) * curve.at(load)


class Flow:
    """One run of a fluid fleet, tick by tick: `begin` (lifecycle; is this a decision tick?),
    then the caller decides if so, then `serve` (arrivals, service, the backlog)."""

    def __init__(self, fleet: FluidFleet, rates: Sequence[float], step_s: float) -> None:
        self.fleet, self.rates, self.step_s = fleet, list(rates), step_s
        tick = fleet.tick_s
        self.interval_ticks = round(fleet.scaling.spec.interval_s / tick)
        self.end = len(self.rates) * step_s
        self.n_ticks = math.ceil(self.end / tick)
        self.backlog: deque[list[float]] = deque()  # [arrival time, requests] buckets, oldest first
        self.queued = self.total = self.met = 0.0
        self.windows = [[k * step_s, 0.0, 0.0] for k in range(len(self.rates))]
        self.k = 0
        self.now = self.rate = 0.0

    @property
    def done(self) -> bool:
        """Past the last window with the backlog drained (or an hour past the last window)."""
        return not (self.k < self.n_ticks or
                    (self.queued > 1e-9 and self.k < self.n_ticks + round(3600 / self.fleet.tick_s)))

    def begin(self) -> tuple[float, float, bool]:
        """(now, the demand's rate now, whether the planner decides at this tick)."""
        fleet = self.fleet
        self.now = now = self.k * fleet.tick_s
        fleet._lifecycle(now)
        self.w = min(len(self.rates) - 1, int(now // self.step_s))
        self.rate = self.rates[self.w] if now < self.end else 0.0
        return now, self.rate, self.k % self.interval_ticks == 0

    def serve(self) -> None:
        fleet, now, rate, tick, w = self.fleet, self.now, self.rate, self.fleet.tick_s, self.w
        scaling, curve = fleet.scaling, fleet.curve
        arrivals = rate * tick
        if arrivals:
            scaling.observe_arrival(now, int(fleet.rng.poisson(arrivals)))
            self.backlog.append([now, arrivals])
            self.queued += arrivals
            self.total += arrivals
        ready = len(scaling.ready_ids())
        can = ready * curve.saturation_rps * tick
        quality = curve.at(min(rate / (ready * curve.capacity_rps), curve.saturation_load)) if ready else 0.0
        served_met = 0.0
        while self.backlog and can > 1e-12:
            bucket = self.backlog[0]
            take = min(bucket[1], can)
            waited = now - bucket[0]
            got = take * quality if waited <= fleet.ttft_s else 0.0
            served_met += got
            ww = min(len(self.rates) - 1, int(bucket[0] // self.step_s))
            self.windows[ww][2] += got
            bucket[1] -= take
            can -= take
            self.queued -= take
            if bucket[1] <= 1e-12:
                self.backlog.popleft()
        if arrivals:
            self.windows[w][1] += arrivals
        self.met += served_met
        self.k += 1

    def result(self) -> FluidResult:
        books = self.fleet.scaling.close(self.k * self.fleet.tick_s)
        return FluidResult(self.total, self.met, max(0.0, self.queued), books.as_dict(),
                           [tuple(x) for x in self.windows])


def window_attainment(result: FluidResult) -> list[float]:
    """Attainment per rate window (1.0 where nothing arrived)."""
    return [m / a if a else 1.0 for _, a, m in result.windows]


__all__ = ["FluidFleet", "FluidResult", "Flow", "ResponseCurve", "window_attainment"]
