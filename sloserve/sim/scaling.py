"""Autoscaling in the simulator: instance lifecycles, cold starts, and the books of a run.

The fleet has a fixed number of slots (the maximum); each slot's instance is `stopped`,
`starting` (loading weights: it serves nothing until its cold start has passed), `ready`
(routed to) or `draining` (out of routing; its running requests move off when the controller
has the `drain` migration policy, else they finish here; it stops once empty). Every
`interval_s` the controller's scale planner sees the demand observed so far and the ready
instances' states, and answers with instances to start, take back, cancel and drain.

A slot pays from the moment its instance is asked to start until it stops (weights occupy the
device while loading): `instance_seconds`. A start whose slot stopped less than `keep_alive_s`
ago finds the weights still in host memory (a warm pool, as ServerlessLLM keeps) and takes
`warm_start_s` instead of `cold_start_s`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from sloserve.fleet_view import DRAINING, READY, STARTING, STOPPED, InstanceSlot, ScalingPlan, ScalingSignals
from sloserve.sched.state import InstanceState


@dataclass(frozen=True)
class ScalingSpec:
    capacity_rps: float  # requests/s one instance sustains within the SLOs (the capacity model's answer)
    initial: int = 1  # instances ready at time 0
    interval_s: float = 60.0  # how often the controller decides
    cold_start_s: float = 120.0  # start to ready, weights from storage
    warm_start_s: Optional[float] = None  # start to ready when the weights are still in host memory
    keep_alive_s: float = 0.0  # how long a stopped instance's weights stay in host memory
    demand_step_s: float = 60.0  # demand is observed in windows of this length

    def __post_init__(self) -> None:
        if not self.capacity_rps > 0:
            raise ValueError(f"instance capacity must be > 0 req/s, got {self.capacity_rps}")
        if self.initial < 0 or not self.interval_s > 0 or self.cold_start_s < 0 or not self.demand_step_s > 0:
            raise ValueError("need initial >= 0, interval > 0, cold start >= 0 and demand step > 0")


@dataclass
class ScalingBooks:
    """What a run's scaling cost and did (SimResult.scaling)."""

    instance_seconds: float = 0.0
    cold_starts: int = 0  # starts that loaded weights from storage
    warm_starts: int = 0
    cancelled: int = 0
    drained: int = 0
    timeline: list = field(default_factory=list)  # (t, ready, starting, draining, demand req/s, target)
    starts: list = field(default_factory=list)  # (slot, asked at, ready at) of every start
    decisions: list = field(default_factory=list)  # (t, target, reason) of each change

    def as_dict(self) -> dict:
        return {"instance_seconds": self.instance_seconds, "instance_hours": self.instance_seconds / 3600,
                "cold_starts": self.cold_starts, "warm_starts": self.warm_starts, "cancelled": self.cancelled,
                "drained": self.drained, "timeline": self.timeline, "decisions": self.decisions,
                "starts": self.starts}


class SimScaling:
    def __init__(self, spec: ScalingSpec, num_slots: int) -> None:
        if spec.initial > num_slots:
            raise ValueError(f"{spec.initial} initial instances do not fit {num_slots} slots")
        self.spec = spec
        self.status = [READY] * spec.initial + [STOPPED] * (num_slots - spec.initial)
        self.on_since: list[Optional[float]] = [0.0] * spec.initial + [None] * (num_slots - spec.initial)
        self.stopped_at: list[Optional[float]] = [None] * num_slots
        self.ready_at: dict[int, float] = {}  # starting slot -> when it serves
        self.arrivals: list[int] = []  # per demand step
        self.books = ScalingBooks()
        self._ready: Optional[list[int]] = None  # ready slots, kept until a status changes (read per arrival)

    # ---- observation ---------------------------------------------------------------------
    def observe_arrival(self, now: float) -> None:
        k = int(now // self.spec.demand_step_s)
        if k >= len(self.arrivals):
            self.arrivals.extend([0] * (k + 1 - len(self.arrivals)))
        self.arrivals[k] += 1

    def demand(self, now: float) -> np.ndarray:
        """Requests/s in each demand window that has ended by `now`."""
        done = int(now // self.spec.demand_step_s)
        counts = self.arrivals[:done] + [0] * max(0, done - len(self.arrivals))
        return np.array(counts, dtype=float) / self.spec.demand_step_s

    def ready_ids(self) -> list[int]:
        if self._ready is None:
            self._ready = [i for i, s in enumerate(self.status) if s == READY]
        return self._ready

    def signals(self, now: float, states: Sequence[InstanceState], held: int = 0) -> ScalingSignals:
        ready = self.ready_ids()
        return ScalingSignals(now, len(ready), self.status.count(STARTING), self.status.count(DRAINING),
                              [states[i] for i in ready], tuple(self.demand(now)), self.spec.demand_step_s,
                              self.spec.capacity_rps, self.spec.cold_start_s, held)

    def offline(self) -> set[int]:
        return {i for i, s in enumerate(self.status) if s in (STOPPED, STARTING)}

    def slots(self, states: Sequence[InstanceState]) -> list[InstanceSlot]:
        return [InstanceSlot(i, s, states[i].predicted_remaining_decode_tokens + states[i].queued_prefill_tokens)
                for i, s in enumerate(self.status)]

    # ---- lifecycle -----------------------------------------------------------------------
    def apply(self, plan: ScalingPlan, now: float) -> list[tuple[int, float]]:
        """Carry out `plan`'s status changes; the (slot, ready time) of each instance started."""
        self._ready = None
        started = []
        for i in plan.undrain:
            self.status[i] = READY
        for i in plan.cancel:
            self.ready_at.pop(i, None)
            self._stop(i, now)
            self.books.cancelled += 1
        for i in plan.drain:
            self.status[i] = DRAINING
            self.books.drained += 1
        free = [i for i, s in enumerate(self.status) if s == STOPPED]
        for i in self._warmest(free)[:plan.start]:
            warm = (self.spec.warm_start_s is not None and self.stopped_at[i] is not None
                    and now - self.stopped_at[i] <= self.spec.keep_alive_s)
            delay = self.spec.warm_start_s if warm else self.spec.cold_start_s
            self.books.warm_starts += warm
            self.books.cold_starts += not warm
            self.status[i] = STARTING
            self.on_since[i] = now
            self.ready_at[i] = now + delay  # type: ignore[operator]
            started.append((i, self.ready_at[i]))
            self.books.starts.append((i, now, self.ready_at[i]))
        if plan.changes:
            self.books.decisions.append((now, plan.target, plan.decision.reason))
        return started

    def _warmest(self, free: list[int]) -> list[int]:
        """Stopped slots, the most recently stopped first (its weights are likeliest still in host memory)."""
        return sorted(free, key=lambda i: -(self.stopped_at[i] if self.stopped_at[i] is not None else -math.inf))

    def became_ready(self, slot: int, now: float) -> bool:
        """The cold start of `slot` ended (False if it was cancelled or restarted meanwhile)."""
        if self.status[slot] != STARTING or self.ready_at.get(slot) != now:
            return False
        del self.ready_at[slot]
        self.status[slot] = READY
        self._ready = None
        return True

    def stop_if_empty(self, slot: int, now: float, empty: bool) -> bool:
        if self.status[slot] == DRAINING and empty:
            self._stop(slot, now)
            return True
        return False

    def _stop(self, slot: int, now: float) -> None:
        since = self.on_since[slot]
        if since is not None:
            self.books.instance_seconds += now - since
        self.on_since[slot] = None
        self.stopped_at[slot] = now
        self.status[slot] = STOPPED
        self._ready = None

    def record(self, now: float, target: int) -> None:
        recent = self.demand(now)
        self.books.timeline.append((now, self.status.count(READY), self.status.count(STARTING),
                                    self.status.count(DRAINING), float(recent[-1]) if len(recent) else 0.0, target))

    def close(self, end: float) -> ScalingBooks:
        for i, since in enumerate(self.on_since):
            if since is not None:
                self.books.instance_seconds += max(0.0, end - since)
                self.on_since[i] = None
        return self.books
