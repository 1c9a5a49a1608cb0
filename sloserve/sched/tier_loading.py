"""Loading KV back from the lower tiers (host memory, disk, the shared store) as the scheduler
plans a step: each step's load budget, how much of a tier hit is worth loading, loads carried
over steps, prefetching the prefixes of the next waiting requests, and pacing tier writes. A mixin
of `Scheduler` (the per-request pricing is tier_loads.py)."""
from __future__ import annotations

import math

from sloserve.kv.tiers import DISK, STORE, TierHit
from sloserve.sched.chunking import tbt_slack
from sloserve.sched.costs import StepLoad
from sloserve.sched.step_build import StepBuild
from sloserve.sched.tier_loads import load_seconds
from sloserve.core.types import Request, RequestStatus

# Waiting requests whose prefixes are staged into host memory ahead of admission, per step.
PREFETCH_AHEAD = 4


class TierLoading:
    def _pace_tier_writes(self, now: float) -> None:
        """Disk and store writes run behind the steps: no faster than their links (as measured
        so far) carry them."""
        tiers, cost = self.kv.tiers, self.tier_cost
        assert cost is not None
        rates = {}
        for tier in (DISK, STORE):
            per_block = cost.tier_time(tier, 1)
            if 0 < per_block < math.inf:
                rates[tier] = 1.0 / per_block
        tiers.write_rates = rates
        tiers.pace_writes(now)

    def _load_budget(self, step: StepBuild) -> float:
        """Seconds of tier loads this step may carry: loads run before the step's compute, so
        they delay every decode in it. Up to the decodes' TBT slack when they have targets, else
        about the step's own compute time (a step at most doubles)."""
        decodes = [item.request for item in step.planned.values()]
        slack = tbt_slack(decodes, step.now)
        if math.isfinite(slack):
            return max(0.0, slack)
        if self.estimator is None:
            return math.inf
        planned = list(step.planned.values())
        n = len(planned)
        return self.estimator.estimate(StepLoad(n, n, n, sum(s.context_len for s in planned)))

    def _affordable(self, hits: list[TierHit], step: StepBuild) -> int:
        """How many leading hits fit the step's load budget (at least one: loading always moves)."""
        if math.isinf(step.load_left) or self.tier_cost is None:
            return len(hits)
        spent, k = 0.0, 0
        for hit in hits:
            spent += self.tier_cost.tier_time(hit.tier, 1)
            if k > 0 and spent > step.load_left:
                break
            k += 1
        return k

    def _load(self, request: Request, first_block: int, hits: list[TierHit], step: StepBuild) -> None:
        self.kv.load_from_tiers(request, first_block, hits)
        self.stats.num_tier_loads += len(hits)
        if math.isfinite(step.load_left):
            step.load_left -= load_seconds(hits, self.tier_cost)

    def _continue_loading(self, request: Request, step: StepBuild) -> None:
        """A request admitted with more prefix to load than one step could carry: load the next
        part (each block from wherever it is now: it may have left its tier, and then the rest is
        recomputed). It computes once its prefix is in."""
        first_block, rest = self._loading[request.request_id]
        fresh = self.kv.tiers.find([h.key for h in rest]) if rest else []
        k = self._affordable(fresh, step) if fresh else 0
        request.num_computed_tokens += k * self.kv.block_size
        if k:
            self._load(request, first_block, fresh[:k], step)
        if k < len(fresh):
            self._loading[request.request_id] = (first_block + k, fresh[k:])
        else:
            del self._loading[request.request_id]

    def _prefetch_waiting(self) -> None:
        """Stage the prefixes of the next few waiting requests from disk or the store into host
        memory while they wait (each request once), so their admission loads over the fast link."""
        for request in self.waiting[:PREFETCH_AHEAD]:
            rid = request.request_id
            if rid in self._prefetched or request.status is RequestStatus.SWAPPED:
                continue
            self._prefetched.add(rid)
            self.stats.num_tier_prefetches += self.kv.prefetch_from_tiers(request)
