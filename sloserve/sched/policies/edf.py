from __future__ import annotations

from sloserve.sched.deadlines import next_deadline
from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.core.types import Request


class EDFPolicy(SchedulingPolicy):
    """Earliest deadline first. A request waiting for its first token is due at its TTFT
    deadline (arrival + TTFT target); once tokens flow, at its TBT deadline (last token + TBT
    target). Ties (and classes without targets, whose deadlines are infinite) fall back to
    arrival order.

    The running queue ends with the latest deadline, so the preemption victim is the request
    that can best afford to wait. Dynamic: TBT deadlines move with every token.
    """

    name = "edf"
    static = False
    interleave_prefills = True
    preempts_for_admission = True

    def key(self, request: Request, seq: int, now: float) -> tuple[float, float, int]:
        return (next_deadline(request), request.arrival_time, seq)
