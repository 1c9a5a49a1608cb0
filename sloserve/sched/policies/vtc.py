from __future__ import annotations

from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.core.types import Request


class VTCPolicy(SchedulingPolicy):
    """Fair sharing between tenants with a Virtual Token Counter (after Sheng et al.,
    "Fairness in Serving Large Language Models", OSDI 2024).

    Each tenant (`Request.tenant`) has a counter of the service it has received: prompt tokens
    computed times `prompt_weight` plus output tokens times `output_weight` (an output token
    costs more: it takes a whole sequence slot in a decode step). The waiting queue is served
    tenant with the smallest counter first, so under contention a tenant with a deep backlog
    cannot keep a light one waiting: it is admitted as soon as it is behind in service. Within
    a tenant, its own priorities then arrival order decide. The running queue is in the same
    order, so memory pressure preempts the request of the best-served tenant first.

    Idle time is not banked: a tenant that becomes active again (its first unfinished request
    here) is lifted to the smallest counter among the tenants that are active, so it competes
    from where they are rather than claiming the service it did not ask for while away.

    Counted: first computation of prompt tokens (a prefix-cache hit is not work; recomputing
    after a preemption is the scheduler's doing, not the tenant's) and every sampled token.
    Counters live on this instance only; no clock is read. Classes' priorities and targets
    are not used across tenants (use `priority`/`edf`/`slo` for that).
    """

    name = "vtc"
    static = False  # counters move with every step
    tracks_service = True
    idle_keep = 256  # idle tenants' counters kept at least (see _forget_idle)

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        if prompt_weight < 0 or output_weight < 0 or prompt_weight + output_weight <= 0:
            raise ValueError("token weights must be >= 0 and not both 0")
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}  # tenants active now, and idle ones above the active minimum
        self._active: dict[str, int] = {}  # tenant -> unfinished requests here

    def key(self, request: Request, seq: int, now: float) -> tuple[float, int, float, int]:
        return (self.counters.get(request.tenant, 0.0), request.effective_priority, request.arrival_time, seq)

    # ---- service accounting ----------------------------------------------------------------
    def on_arrival(self, request: Request) -> None:
        tenant = request.tenant
        count = self._active.get(tenant, 0)
        if count == 0 and self._active:
            floor = self._active_minimum()
            if self.counters.get(tenant, 0.0) < floor:
                self.counters[tenant] = floor
        self._active[tenant] = count + 1

    def on_service(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        if request.num_preemptions:
            prompt_tokens = 0  # recomputation (or the rest of a swapped prefill): not charged
        cost = prompt_tokens * self.prompt_weight + output_tokens * self.output_weight
        if cost:
            self.counters[request.tenant] = self.counters.get(request.tenant, 0.0) + cost

    def on_departure(self, request: Request) -> None:
        tenant = request.tenant
        count = self._active.get(tenant, 0) - 1
        if count > 0:
            self._active[tenant] = count
            return
        self._active.pop(tenant, None)
        self._forget_idle()

    def service(self, tenant: str) -> float:
        """The tenant's counter (0 for a tenant never seen or forgotten)."""
        return self.counters.get(tenant, 0.0)

    # ---- internals ---------------------------------------------------------------------------
    def _active_minimum(self) -> float:
        counters = self.counters
        return min(counters.get(t, 0.0) for t in self._active)

    def _forget_idle(self) -> None:
        """Bound the idle tenants kept. With nobody active, drop all. Otherwise, once they are
        many, drop those whose counter a return would lift anyway (at or below the active
        minimum, which never falls while anyone is active), then, if still too many, those
        with the smallest lead (forgetting a small lead costs the least fairness)."""
        if not self._active:
            self.counters.clear()
            return
        idle = len(self.counters) - len(self._active)
        if idle <= 2 * self.idle_keep:
            return  # amortized: a sweep runs once per idle_keep departures at most
        floor = self._active_minimum()
        ranked = sorted((c, t) for t, c in self.counters.items() if t not in self._active)
        drop = [t for c, t in ranked if c <= floor]
        drop += [t for _, t in ranked[len(drop):len(ranked) - self.idle_keep]]
        for tenant in drop:
            del self.counters[tenant]
