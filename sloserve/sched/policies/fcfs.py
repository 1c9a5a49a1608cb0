from __future__ import annotations

from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.core.types import Request


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: vLLM's default and the baseline everything is compared with."""

    name = "fcfs"

    def key(self, request: Request, seq: int, now: float) -> tuple[float, int]:
        return (request.arrival_time, seq)
