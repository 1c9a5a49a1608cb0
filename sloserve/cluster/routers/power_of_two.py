from __future__ import annotations

import random
from typing import Optional, Sequence

from sloserve.cluster.routers.base import Router, RouterOptions
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


class PowerOfTwoRouter(Router):
    """Two instances drawn at random, the less loaded one wins (Mitzenmacher's power of two
    choices): nearly the balance of least-loaded while looking at only two snapshots, and
    no herding when many routers act on the same stale view.

    Load is running + waiting requests; ties go to the lower KV demand, then the first draw.
    The RNG is injected so a simulated run is reproducible."""

    name = "power-of-two"

    def __init__(self, rng: Optional[random.Random] = None):
        self.rng = rng if rng is not None else random.Random(0)

    @classmethod
    def from_options(cls, options: RouterOptions) -> "PowerOfTwoRouter":
        return cls(options.make_rng())

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        n = len(states)
        if n == 1:
            return 0
        a, b = self.rng.sample(range(n), 2)
        sa, sb = states[a], states[b]
        return b if (sb.num_requests, sb.kv_demand) < (sa.num_requests, sa.kv_demand) else a
