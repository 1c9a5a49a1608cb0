from __future__ import annotations

from typing import Sequence

from sloserve.cluster.routers.base import Router, argmin
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


class LeastKVRouter(Router):
    """Lowest KV demand: blocks in use plus blocks the waiting queue will take, over the pool.

    Counting the waiting queue matters: requests routed while an instance's step is in
    flight hold no blocks yet, and a router reading only blocks in use would send a whole
    burst to the instance that looked empty. Ties: fewer requests, then lowest index."""

    name = "least-kv"

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        return argmin(len(states), lambda i: (states[i].kv_demand, states[i].num_requests))
