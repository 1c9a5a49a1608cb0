from __future__ import annotations

from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.core.types import Request


class PriorityPolicy(SchedulingPolicy):
    """Static priority (lower value first), FCFS within a priority, as vLLM's `priority`."""

    name = "priority"

    def key(self, request: Request, seq: int, now: float) -> tuple[int, float, int]:
        return (request.effective_priority, request.arrival_time, seq)
