from __future__ import annotations

from typing import Sequence

from sloserve.cluster.routers.base import Router
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


class LeastRequestsRouter(Router):
    """Fewest running + waiting requests (ties: lowest index). Assumes requests cost the same."""

    name = "least-requests"

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        counts = [states[i].num_requests for i in range(len(states))]
        return counts.index(min(counts))  # the first of the least loaded
