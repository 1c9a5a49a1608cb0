from __future__ import annotations

import math
from typing import Sequence

from sloserve.cluster.routers.base import Router, RouterOptions, argmin
from sloserve.cluster.routers.prefix import DEFAULT_MAX_BLOCKS, prefix_matches
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


class PrefixAffinityRouter(Router):
    """Send a request where its prompt's prefix is cached, within a load bound.

    The rule of consistent hashing with bounded loads (Mirrokni et al.): with m requests in
    the fleet (this one included) and n instances, no instance may hold more than
    ceil((1 + epsilon) * m / n) (and `min_bound`, see below). Among the instances under that bound the longest cached
    prefix wins (ties: fewer requests, then lowest index); with no usable match anywhere the
    least-loaded instance takes it. A popular prefix therefore spreads to a second instance
    as soon as its home is epsilon above the mean, instead of piling up there (the
    hot-spotting of routers that follow the cache unconditionally). The least-loaded
    instance is always under the bound, so a choice always exists.

    `min_bound`: the bound never drops below this many requests. At light load the mean is
    a fraction of a request and ceil((1 + epsilon) * m / n) is 1, which would refuse the
    holder its own conversation's next turn while it runs anything at all; an instance with
    a handful of requests is far from busy (it batches hundreds), so the cache wins there.
    `min_match_blocks`: a shorter match is not worth the affinity (a shared one-block
    system prompt should not decide placement).
    """

    name = "prefix-affinity"

    def __init__(self, epsilon: float = 0.25, min_bound: int = 4, min_match_blocks: int = 1,
                 max_probe_blocks: int = DEFAULT_MAX_BLOCKS):
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        self.epsilon = epsilon
        self.min_bound = max(1, min_bound)
        self.min_match_blocks = max(1, min_match_blocks)
        self.max_probe_blocks = max_probe_blocks

    @classmethod
    def from_options(cls, options: RouterOptions) -> "PrefixAffinityRouter":
        return cls(epsilon=options.epsilon)

    def load_bound(self, states: Sequence[InstanceState]) -> int:
        """Most requests an instance may hold after taking this one."""
        total = sum(s.num_requests for s in states) + 1
        return max(self.min_bound, math.ceil((1.0 + self.epsilon) * total / len(states)))

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        n = len(states)
        loads = [states[i].num_requests for i in range(n)]
        bound = self.load_bound(states)
        matches = prefix_matches(request, states, self.max_probe_blocks)
        best, best_key = -1, None
        for i in range(n):
            if matches[i] < self.min_match_blocks or loads[i] + 1 > bound:
                continue
            key = (-matches[i], loads[i], i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        if best >= 0:
            return best
        return argmin(n, lambda i: (loads[i], states[i].kv_demand))
