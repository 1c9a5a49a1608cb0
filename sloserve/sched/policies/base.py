"""The instance-scheduling policy interface: one ordering decides admission and preemption."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

from sloserve.sched.costs import StepCostEstimator
from sloserve.core.types import Request


class SchedulingPolicy(ABC):
    """Orders requests: a smaller key is served first and preempted last.

    `static` policies give each request a key that never changes, so the waiting queue
    stays sorted on insertion; dynamic ones (deadline slack) are re-sorted every step.

    Besides the order, a policy switches on the scheduler behaviours it relies on (all off
    by default, which is the vLLM-like baseline):
    - `interleave_prefills`: running prefills and waiting requests share the step's prefill
      budget in policy order (a long low-class prefill in progress does not hold back an
      urgent newcomer); otherwise running prefills go first.
    - `preempts_for_admission`: a waiting request that finds no blocks or no seat may preempt
      the lowest-ranked running request when `may_preempt` allows it.
    - `dynamic_chunking`: the step's prefill tokens are sized from the TBT slack of the
      running decodes (needs a step-cost estimator; the config can override).
    - `tracks_service`: the scheduler reports arrivals, the work done for each request and
      departures (`on_arrival`, `on_service`, `on_departure`), for policies whose order depends
      on what a tenant has received (fair sharing). Off, the scheduler makes no such calls.
    """

    name: ClassVar[str]
    static: ClassVar[bool] = True
    interleave_prefills: ClassVar[bool] = False
    preempts_for_admission: ClassVar[bool] = False
    dynamic_chunking: ClassVar[bool] = False
    tracks_service: ClassVar[bool] = False
    # Orders by estimated prefill time: the scheduler estimates each arrival's prefix hits
    # (request.expected_cached_tokens / expected_load_s) for it.
    prices_prefills: ClassVar[bool] = False

    def bind(self, estimator: Optional[StepCostEstimator], max_chunk: int) -> None:
        """Called once by the scheduler: the step-cost estimator (or None) and the largest
        prefill chunk a step can take. Policies that price work in seconds keep them."""

    @abstractmethod
    def key(self, request: Request, seq: int, now: float) -> Any:
        """`seq` is the request's arrival order at this instance (a stable tie-breaker)."""

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        """Whether waiting `candidate` may take the place of running `victim` (only asked when
        `preempts_for_admission`). Strictly higher classes only, so requests of one class
        never preempt each other back and forth."""
        return candidate.effective_priority < victim.effective_priority

    # ---- service hooks (called only when `tracks_service`) --------------------------------
    def on_arrival(self, request: Request) -> None:
        """A request joined this instance (before it is queued, so its key can use what this
        call sets)."""

    def on_service(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """A step (or a fast-forwarded run of decode steps) computed `prompt_tokens` tokens of
        the request's prompt (recomputation after a preemption included) and sampled
        `output_tokens` tokens for it."""

    def on_departure(self, request: Request) -> None:
        """The request left this instance (finished or aborted)."""
