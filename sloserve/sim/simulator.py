"""The discrete-event loop: arrivals, routing and step completions on a heap of timed events.

No polling: an instance is woken only by an event that can change what it does (a request
routed to it, or the end of its own step). Simulated time never touches the wall clock.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Callable, Iterable, Iterator, Optional

from sloserve.cluster.routers.base import Router
from sloserve.sched.live_state import Moment
from sloserve.sim.instance import SimInstance
from sloserve.types import Request

logger = logging.getLogger(__name__)

# At equal times: every arrival is queued first, then idle instances wake (so requests that
# arrive together share the first step, as they would in the engine loop), then steps end.
ARRIVAL, WAKE, STEP_END = 0, 1, 2


@dataclass
class FinishedRequest:
    request: Request
    instance_id: int


@dataclass
class SimResult:
    finished: list[FinishedRequest]  # empty when the run reported requests through `on_done`
    rejected: list[tuple[Request, str]]  # requests no instance could accept, with the reason
    end_time: float
    num_events: int
    num_finished: int = 0
    instance_busy_time: list[float] = field(default_factory=list)


class Simulator:
    def __init__(self, instances: Sequence[SimInstance], router: Router):
        if not instances:
            raise ValueError("need at least one instance")
        self.instances = list(instances)
        self.router = router
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._waking: set[int] = set()
        self.now = 0.0
        # One live view per instance for the whole run, read at the moment of each arrival.
        self._moment = Moment()
        self._states = [instance.live_view(self._moment) for instance in self.instances]

    def _push(self, time: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (time, kind, next(self._seq), payload))

    def run(self, requests: Iterable[Request], on_progress: Optional[Callable[[float, int], None]] = None,
            until: Optional[float] = None,
            on_done: Optional[Callable[[Request, Optional[str]], None]] = None) -> SimResult:
        """Simulate until every request has finished (or `until` seconds of simulated time).

        `requests` must come in arrival order; they are pulled lazily, so a generator of a
        million requests never sits in memory at once. With `on_done(request, error)` each
        request is handed over when it finishes (error None) or is rejected, and not kept.
        """
        arrivals: Iterator[Request] = iter(requests)
        finished: list[FinishedRequest] = []
        rejected: list[tuple[Request, str]] = []
        num_finished = 0
        events = 0
        last_arrival = -float("inf")
        pending = next(arrivals, None)
        if pending is not None:
            self._push(pending.arrival_time, ARRIVAL, pending)
        while self._heap:
            time, kind, _, payload = heapq.heappop(self._heap)
            if until is not None and time > until:
                break
            self.now = time
            events += 1
            if kind == ARRIVAL:
                request = payload
                if request.arrival_time < last_arrival:
                    raise ValueError(f"requests are not in arrival order at {request.request_id!r}")
                last_arrival = request.arrival_time
                error = self._arrive(request)
                if error is not None:
                    if on_done is not None:
                        on_done(request, error)
                    else:
                        rejected.append((request, error))
                pending = next(arrivals, None)
                if pending is not None:
                    self._push(pending.arrival_time, ARRIVAL, pending)
            elif kind == WAKE:
                instance = payload
                self._waking.discard(instance.instance_id)
                if not instance.is_busy:
                    self._start(instance)
            else:
                instance, end = payload
                if instance.busy_until != end:
                    continue  # a decode run cut short by an arrival: its old end no longer stands
                for request in instance.finish_step(time):
                    num_finished += 1
                    if on_done is not None:
                        on_done(request, None)
                    else:
                        finished.append(FinishedRequest(request, instance.instance_id))
                self._start(instance)
            if on_progress is not None and events % 1024 == 0:
                on_progress(self.now, num_finished)
        if on_progress is not None:
            on_progress(self.now, num_finished)
        return SimResult(finished, rejected, self.now, events, num_finished, [i.busy_time for i in self.instances])

    def _arrive(self, request: Request) -> Optional[str]:
        """Route and queue an arrival; returns why it was rejected, if it was."""
        self._moment.advance(self.now)
        choice = self.router.route(request, self._states)
        instance = self.instances[choice]
        try:
            instance.add_request(request)
        except ValueError as e:  # e.g. longer than the context window: the server would answer 400
            return str(e)
        if not instance.is_busy:
            if instance.instance_id not in self._waking:
                self._waking.add(instance.instance_id)
                self._push(self.now, WAKE, instance)
        else:
            new_end = instance.interrupt(self.now)
            if new_end is not None:
                self._push(new_end, STEP_END, (instance, new_end))
        return None

    def _start(self, instance: SimInstance) -> None:
        end = instance.start_step(self.now)
        if end is not None:
            self._push(end, STEP_END, (instance, end))
