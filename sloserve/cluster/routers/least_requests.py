from __future__ import annotations

from typing import Sequence

from sloserve.cluster.routers.base import Router
from sloserve.sched.state import InstanceState
from sloserve.types import Request


class LeastRequestsRouter(Router):
    """Fewest running + waiting requests (ties: lowest index). Assumes requests cost the same."""

    name = "least-requests"

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        return min(range(len(states)), key=lambda i: (states[i].num_requests, i))
