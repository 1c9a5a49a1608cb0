"""Autoscaling in the simulator: instance lifecycles, cold starts, and the books of a run.

The fleet has a fixed number of slots (the maximum); each slot's instance is `stopped`,
`starting` (loading weights: it serves nothing until its cold start has passed), `ready`
(routed to) or `draining` (out of routing; its running requests move off when the controller
has the `drain` migration policy, else they finish here; it stops once empty). Every
`interval_s` the controller's scale planner sees the demand observed so far and the ready
instances' states, and answers with instances to start, take back, cancel and drain.

A prefill/decode-disaggregated fleet scales its two pools apart: each slot keeps its role, and
the controller plans each pool on its own signals (the pool's instances, its per-instance
capacity), since prompts and outputs grow at different rates (DistServe, Splitwise, and Dynamo's
planner size the pools separately).

A slot pays from the moment its instance is asked to start until it stops (weights occupy the
device while loading): `instance_seconds`. A start whose slot stopped less than `keep_alive_s`
ago finds the weights still in host memory (a warm pool, as ServerlessLLM keeps) and takes
`warm_start_s` instead of `cold_start_s`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from sloserve.cluster.autoscale.demand import DemandMeter
from sloserve.cluster.autoscale.execute import apply_plan
from sloserve.fleet_view import DRAINING, READY, STARTING, STOPPED, InstanceSlot, ScalingPlan, ScalingSignals
from sloserve.sched.state import InstanceState


@dataclass(frozen=True)
class ScalingSpec:
    capacity_rps: float  # requests/s one instance sustains within the SLOs (the capacity model's answer)
    initial: int = 1  # instances ready at time 0 (per pool)
    interval_s: float = 60.0  # how often the controller decides
    cold_start_s: float = 120.0  # start to ready, weights from storage
    warm_start_s: Optional[float] = None  # start to ready when the weights are still in host memory
    keep_alive_s: float = 0.0  # how long a stopped instance's weights stay in host memory
    demand_step_s: float = 60.0  # demand is observed in windows of this length
    # Per pool ("prefill", "decode") where it differs from the above: one prefill instance carries
    # another request rate than one decode instance.
    pool_capacity: Mapping[str, float] = field(default_factory=dict)
    pool_initial: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rate in (self.capacity_rps, *self.pool_capacity.values()):
            if not rate > 0:
                raise ValueError(f"instance capacity must be > 0 req/s, got {rate}")
        if min([self.initial, *self.pool_initial.values()]) < 0 or not self.interval_s > 0 or self.cold_start_s < 0 \
                or not self.demand_step_s > 0:
            raise ValueError("need initial >= 0, interval > 0, cold start >= 0 and demand step > 0")

    def capacity(self, pool: str) -> float:
        return self.pool_capacity.get(pool, self.capacity_rps)

    def initial_for(self, pool: str) -> int:
        return self.pool_initial.get(pool, self.initial)


@dataclass
class ScalingBooks:
    """What a run's scaling cost and did (SimResult.scaling)."""

    instance_seconds: float = 0.0
    pool_seconds: dict = field(default_factory=dict)  # the same, per pool
    cold_starts: int = 0  # starts that loaded weights from storage
    warm_starts: int = 0
    cancelled: int = 0
    drained: int = 0
    timeline: list = field(default_factory=list)  # (t, ready, starting, draining, demand req/s, target): all pools
    pool_timeline: list = field(default_factory=list)  # (t, pool, ready, starting, draining, target)
    starts: list = field(default_factory=list)  # (slot, asked at, ready at) of every start
    decisions: list = field(default_factory=list)  # (t, target, reason) of each change ("pool: reason" with pools)

    def as_dict(self) -> dict:
        return {"instance_seconds": self.instance_seconds, "instance_hours": self.instance_seconds / 3600,
                "pool_instance_hours": {p: s / 3600 for p, s in self.pool_seconds.items()},
                "cold_starts": self.cold_starts, "warm_starts": self.warm_starts, "cancelled": self.cancelled,
                "drained": self.drained, "timeline": self.timeline, "pool_timeline": self.pool_timeline,
                "decisions": self.decisions, "starts": self.starts}


class SimScaling:
    def __init__(self, spec: ScalingSpec, roles: Sequence[str]) -> None:
        """`roles`: each slot's fleet_view role; a pool is the slots of one role."""
        self.spec = spec
        self.roles = list(roles)
        self.pools = list(dict.fromkeys(self.roles))  # "mixed", or "prefill" and "decode"
        self.status: list[str] = []
        seen: dict[str, int] = {}
        for role in self.roles:
            seen[role] = seen.get(role, 0) + 1
            self.status.append(READY if seen[role] <= spec.initial_for(role) else STOPPED)
        for pool in self.pools:
            if spec.initial_for(pool) > seen[pool]:
                raise ValueError(f"{spec.initial_for(pool)} initial {pool} instances do not fit {seen[pool]} slots")
        self.on_since: list[Optional[float]] = [0.0 if s == READY else None for s in self.status]
        self.stopped_at: list[Optional[float]] = [None] * len(self.roles)
        self.ready_at: dict[int, float] = {}  # starting slot -> when it serves
        self.meter = DemandMeter(spec.demand_step_s)
        self.books = ScalingBooks(pool_seconds={pool: 0.0 for pool in self.pools})
        self._ready: dict[tuple[str, ...], list[int]] = {}  # ready slots per pools, kept until a status changes

    @property
    def disaggregated(self) -> bool:
        return self.pools != ["mixed"]

    # ---- observation ---------------------------------------------------------------------
    def observe_arrival(self, now: float, count: int = 1) -> None:
        """`count` requests arrived at `now` (the fluid fleet observes a tick's arrivals at once)."""
        self.meter.observe(now, count)

    def demand(self, now: float) -> np.ndarray:
        """Requests/s in each demand window that has ended by `now`."""
        return np.array(self.meter.rates(now), dtype=float)

    def ready_ids(self, *pools: str) -> list[int]:
        """Ready slots of `pools` (of every pool if none is named); read per arrival, so cached."""
        ids = self._ready.get(pools)
        if ids is None:
            ids = self._ready[pools] = [i for i, s in enumerate(self.status)
                                        if s == READY and (not pools or self.roles[i] in pools)]
        return ids

    def _in(self, pool: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == pool]

    def count(self, status: str, pool: Optional[str] = None) -> int:
        return sum(s == status and (pool is None or self.roles[i] == pool) for i, s in enumerate(self.status))

    def signals(self, now: float, states: Sequence[InstanceState], held: int = 0,
                pool: str = "mixed") -> ScalingSignals:
        ready = self.ready_ids(pool)
        return ScalingSignals(now, len(ready), self.count(STARTING, pool), self.count(DRAINING, pool),
                              [states[i] for i in ready], tuple(self.demand(now)), self.spec.demand_step_s,
                              self.spec.capacity(pool), self.spec.cold_start_s, held, pool)

    def offline(self) -> set[int]:
        return {i for i, s in enumerate(self.status) if s in (STOPPED, STARTING)}

    def slots(self, states: Sequence[InstanceState], pool: str = "mixed") -> list[InstanceSlot]:
        return [InstanceSlot(i, self.status[i],
                             states[i].predicted_remaining_decode_tokens + states[i].queued_prefill_tokens)
                for i in self._in(pool)]

    # ---- lifecycle -----------------------------------------------------------------------
    def apply(self, plan: ScalingPlan, now: float, pool: str = "mixed") -> list[tuple[int, float]]:
        """Carry out `plan`'s status changes in `pool`; the (slot, ready time) of each instance started."""
        self._ready = {}
        started = apply_plan(plan, _SimPort(self, now), pool)
        if plan.changes:
            reason = f"{pool}: {plan.decision.reason}" if self.disaggregated else plan.decision.reason
            self.books.decisions.append((now, plan.target, reason))
        return [(i, self.ready_at[i]) for i in started]

    def _warmest(self, free: list[int]) -> list[int]:
        """Stopped slots, the most recently stopped first (its weights are likeliest still in host memory)."""
        return sorted(free, key=lambda i: -(self.stopped_at[i] if self.stopped_at[i] is not None else -math.inf))

    def became_ready(self, slot: int, now: float) -> bool:
        """The cold start of `slot` ended (False if it was cancelled or restarted meanwhile)."""
        if self.status[slot] != STARTING or self.ready_at.get(slot) != now:
            return False
        del self.ready_at[slot]
        self.status[slot] = READY
        self._ready = {}
        return True

    def stop_if_empty(self, slot: int, now: float, empty: bool) -> bool:
        if self.status[slot] == DRAINING and empty:
            self._stop(slot, now)
            return True
        return False

    def _stop(self, slot: int, now: float) -> None:
        self._pay(slot, now)
        self.stopped_at[slot] = now
        self.status[slot] = STOPPED
        self._ready = {}

    def _pay(self, slot: int, until: float) -> None:
        since = self.on_since[slot]
        if since is not None:
            seconds = max(0.0, until - since)
            self.books.instance_seconds += seconds
            self.books.pool_seconds[self.roles[slot]] += seconds
        self.on_since[slot] = None

    def record(self, now: float, targets: dict[str, int]) -> None:
        """A timeline point: instances per status (all pools, and per pool) and the targets."""
        recent = self.demand(now)
        self.books.timeline.append((now, self.count(READY), self.count(STARTING), self.count(DRAINING),
                                    float(recent[-1]) if len(recent) else 0.0, sum(targets.values())))
        if self.disaggregated:
            for pool in self.pools:
                self.books.pool_timeline.append((now, pool, self.count(READY, pool), self.count(STARTING, pool),
                                                 self.count(DRAINING, pool), targets.get(pool, 0)))

    def close(self, end: float) -> ScalingBooks:
        for i in range(len(self.on_since)):
            self._pay(i, end)
        return self.books


class _SimPort:
    """`SimScaling` as a scaling port (cluster/autoscale/execute.py) at time `now`."""

    def __init__(self, scaling: SimScaling, now: float) -> None:
        self.scaling, self.now = scaling, now

    def undrain(self, slot: int) -> None:
        self.scaling.status[slot] = READY

    def cancel(self, slot: int) -> None:
        self.scaling.ready_at.pop(slot, None)
        self.scaling._stop(slot, self.now)
        self.scaling.books.cancelled += 1

    def drain(self, slot: int) -> None:
        self.scaling.status[slot] = DRAINING
        self.scaling.books.drained += 1

    def stopped(self, pool: str) -> list[int]:
        s = self.scaling
        return s._warmest([i for i in s._in(pool) if s.status[i] == STOPPED])

    def start(self, slot: int) -> None:
        s, now, spec = self.scaling, self.now, self.scaling.spec
        warm = (spec.warm_start_s is not None and s.stopped_at[slot] is not None
                and now - s.stopped_at[slot] <= spec.keep_alive_s)
        delay = spec.warm_start_s if warm else spec.cold_start_s
        s.books.warm_starts += warm
        s.books.cold_starts += not warm
        s.status[slot] = STARTING
        s.on_since[slot] = now
        s.ready_at[slot] = now + delay  # type: ignore[operator]
        s.books.starts.append((slot, now, s.ready_at[slot]))
