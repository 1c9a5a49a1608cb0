from __future__ import annotations

from typing import Optional

from sloserve.sched.costs import StepCostEstimator, StepLoad, prefill_time
from sloserve.sched.deadlines import tbt_deadline, ttft_deadline
from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.core.types import Request

_CACHE_LIMIT = 200_000


class SLOPolicy(SchedulingPolicy):
    """SLO-driven hybrid priority in the spirit of Niyama (QoS-aware instance scheduling).

    - Order: deadline slack plus remaining work. A request waiting for its first token scores
      `slack + w * work`, where slack = TTFT deadline - now - least remaining prefill time (the
      latest moment it can still start, as in least-laxity-first) and work = the compute it
      still needs (remaining prefill plus, when a predicted output length is known, its
      remaining output at the marginal cost of a token). With w > 1 short jobs go first among
      requests due about together (SRPT), while a much earlier deadline still wins (EDF). Once
      tokens flow, the slack is to its TBT deadline. `now` is common to every key of one sort,
      so the key leaves it out. The class's `weight` divides the work term: among requests due
      about together, a class of weight 2 is served as if its jobs were half as long.
    - Relegation: a request whose TTFT deadline can no longer be met even if it ran alone from
      now on (now + least remaining prefill time > deadline) moves behind every request that
      can still make it, in arrival order. It is deprioritized, never dropped: it runs as soon
      as nobody meetable needs the capacity. This is what keeps overload from turning into
      every request missing by a little.
    - Higher classes may preempt lower ones for blocks or seats (not relegated ones), prefills
      share the budget in this order, and the step's prefill size follows the TBT slack of
      the running decodes (dynamic chunking).

    The least remaining prefill time comes from the injected step-cost estimator (full-budget
    chunks, nothing else in the step), after the prefix the scheduler expected the request to
    hit at its arrival, plus the time to load that prefix's lower-tier part. Without an estimator it
    is 0, so a request is relegated only once its deadline has passed.
    """

    name = "slo"
    static = False
    interleave_prefills = True
    preempts_for_admission = True
    dynamic_chunking = True
    prices_prefills = True

    def __init__(self, work_weight: float = 2.0) -> None:
        self.work_weight = work_weight
        self._estimator: Optional[StepCostEstimator] = None
        self._chunk = 1
        self._token_s = 0.0
        self._version: Optional[int] = None
        self._prefill_cache: dict[tuple[int, int], float] = {}

    def bind(self, estimator: Optional[StepCostEstimator], max_chunk: int) -> None:
        self._estimator = estimator
        self._chunk = max(1, max_chunk)
        self._refresh()

    def _refresh(self) -> None:
        """(Re)price from the estimator. An estimator that learns while serving (it counts its
        observations in `num_observed`) invalidates the cached prefill times as it learns."""
        self._version = getattr(self._estimator, "num_observed", None)
        self._prefill_cache.clear()
        # Marginal cost of one token when batched: what an output token adds to the work.
        est = self._estimator
        self._token_s = est.estimate(StepLoad.prefill(self._chunk)) / self._chunk if est is not None else 0.0

    # ---- the pieces of the key -------------------------------------------------------
    def min_prefill_time(self, request: Request) -> float:
        """Least time until this request's first token if it ran alone from now on: a request
        not yet admitted skips the prefix the scheduler expects it to hit, and pays for loading
        the part of it that sits in a lower KV tier."""
        start, end = request.num_computed_tokens, request.num_prompt_tokens
        load_s = 0.0
        if request.first_scheduled_time is None and request.expected_cached_tokens > start:
            start, load_s = request.expected_cached_tokens, request.expected_load_s
        if self._estimator is None or end <= start:
            return load_s
        if self._version is not None and self._version != self._estimator.num_observed:  # type: ignore[attr-defined]
            self._refresh()
        cached = self._prefill_cache.get((start, end))
        if cached is None:
            if len(self._prefill_cache) >= _CACHE_LIMIT:
                self._prefill_cache.clear()
            cached = self._prefill_cache[(start, end)] = prefill_time(self._estimator, start, end - start, self._chunk)
        return cached + load_s

    def is_relegated(self, request: Request, now: float) -> bool:
        """True only when the TTFT deadline is already unmeetable."""
        if request.first_token_time is not None:
            return False  # TTFT is history; its TBT is served by deadline order
        return now + self.min_prefill_time(request) > ttft_deadline(request)

    def remaining_work(self, request: Request) -> float:
        """Seconds of compute the request still needs (prefill, plus predicted output)."""
        work = self.min_prefill_time(request) if request.first_token_time is None else 0.0
        if request.predicted_output_len is not None:
            work += max(0, request.predicted_output_len - request.num_output_tokens) * self._token_s
        return work

    # ---- the policy ---------------------------------------------------------------------
    def key(self, request: Request, seq: int, now: float) -> tuple[int, float, int]:
        if request.first_token_time is None:
            need = self.min_prefill_time(request)
            deadline = ttft_deadline(request)
            if now + need > deadline:
                return (1, request.arrival_time, seq)
            score = deadline - need
        else:
            score = tbt_deadline(request)
        weight = request.qos.weight if request.qos.weight > 0 else 1.0
        return (0, score + self.work_weight * self.remaining_work(request) / weight, seq)

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        return super().may_preempt(candidate, victim, now) and not self.is_relegated(candidate, now)
