"""The front's view of its workers between two polls: the last snapshot, plus what it routed since, less
the relays that ended since (no workers started: a fleet of stand-in handles and a hand-set clock)."""
from __future__ import annotations

from fleet_helpers import StandInHandle, front_config
from sloserve.sched.state import InstanceState
from sloserve.front.multi import build_worker_fleet
from sloserve.core.types import Request, SamplingParams
from sloserve.workers.fleet import HEALTHY


def _snapshot(running: int, waiting: int = 0) -> InstanceState:
    return InstanceState(running, waiting, 0, 0, 100, 100, 0, 0.0, float("inf"), 16)


def test_a_stream_that_ended_since_the_poll_no_longer_counts_and_least_requests_sees_it():
    now = [10.0]
    fleet = build_worker_fleet(lambda slot: StandInHandle(), front_config(instances=2, router="least-requests"),
                               clock=lambda: now[0])
    a, b = fleet.instances
    for inst in (a, b):
        inst.status = HEALTHY
        inst.state = _snapshot(1)  # the last poll saw one stream on each
        inst.in_flight = 1
    b.relay_ended(now[0])  # b's stream ended before the next poll: b is the idle one (a tie would pick a)
    assert b.in_flight == 0 and b.routing_state(16).num_requests == 0 and a.routing_state(16).num_requests == 1
    assert fleet.pick(Request("r", [1, 2, 3], SamplingParams(max_tokens=4)), set()) is b
    assert b.routing_state(16).num_requests == 1  # what it routed counts until the next poll
    b.in_flight += 1
    b.relay_ended(now[0])  # ... unless it ended too: routed and gone, it counts for nothing
    assert b.routing_state(16).num_requests == 0


def test_departures_never_make_counts_negative():
    fleet = build_worker_fleet(lambda slot: StandInHandle(), front_config(router="least-requests"))
    inst = fleet.instances[0]
    inst.state = _snapshot(0, 1)  # one waiting; then two relays end (one the snapshot never saw)
    inst.in_flight = 2
    inst.relay_ended(1.0)
    inst.relay_ended(1.0)
    state = inst.routing_state(16)
    assert (state.num_running, state.num_waiting) == (0, 0)
