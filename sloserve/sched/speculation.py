"""SLO-aware speculation: which running decodes carry draft tokens this step, and how many.

Verifying k drafts makes a request's step compute k + 1 tokens instead of one. On a
memory-bound step (a handful of decodes: the weights are read once whatever the rows) the
extra rows are nearly free and every accepted draft is a token gained; on a compute-bound
step (many decodes, or a big prefill chunk) they cost about what a token costs and slow
every request in the step. So the scheduler asks, per step:

* throughput: is the expected number of tokens the step yields, per estimated second, higher
  with the drafts than without? Expected accepted drafts come from each request's own
  acceptance history (a draft is accepted only if all before it were, so k drafts at
  per-draft acceptance a yield a + a^2 + ... + a^k tokens);
* latency: does the longer step still end within the tightest TBT slack of the decodes
  (a step that makes one request's next token late is not worth another's gain)?

Steps are priced by the measured cost of pure-decode steps of each row count (DecodeRowCosts),
falling back to the scheduler's step estimator for row counts not seen yet (so a first verify
step teaches the table what it costs). Drafts ride only in pure-decode steps (the scheduler
offers no other): a step carrying a prefill chunk is compute-bound already, and drafts never take
budget a prompt could use. Greedy requests without logprobs only: their verified output is
exactly what plain decoding gives (see engine/runner.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sloserve.sched.costs import DecodeRowCosts, StepCostEstimator, StepLoad
from sloserve.sched.drafts import DraftProposer
from sloserve.core.types import Request

PRIOR_ACCEPTANCE = 0.5  # a request's per-draft acceptance before it has any history
HISTORY_WEIGHT = 0.7  # how much of the old estimate survives each verified step (EMA)


@dataclass
class SpeculationStats:
    num_draft_tokens: int = 0  # proposed and verified
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # steps that carried any drafts
    num_skipped_steps: int = 0  # steps with drafts on offer that the cost check turned down

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Plans drafts for a step and learns each request's acceptance rate."""

    def __init__(self, proposer: DraftProposer, num_tokens: int, max_batch: int,
                 estimator: Optional[StepCostEstimator] = None, min_gain: float = 1.05):
        """`num_tokens`: drafts per request at most; `max_batch`: no speculation in steps with
        more decodes (the only rule while nothing can price steps); `min_gain`: the expected
        tokens-per-second ratio a step with drafts must reach over one without."""
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.estimator = estimator
        self.min_gain = min_gain
        self.stats = SpeculationStats()
        self.row_costs = DecodeRowCosts()
        self._acceptance: dict[str, float] = {}

    @staticmethod
    def eligible(request: Request) -> bool:
        """Greedy requests without logprobs (one with a structured output too: the runner masks
        each verified position by its constraint)."""
        params = request.sampling_params
        return params.greedy and params.logprobs is None

    def plan(self, decodes: list[Request], budget: int, slack_s: float,
             room: dict[str, int]) -> dict[str, list[int]]:
        """Drafts per request id for a pure-decode step, or {} when they do not pay.

        `decodes`: the step's planned decodes (all of it); `budget`: tokens left in the step;
        `slack_s`: the tightest TBT slack among the decodes; `room[request_id]`: the most
        drafts that request may take."""
        if budget <= 0 or not decodes or len(decodes) > self.max_batch:
            return {}
        drafts: dict[str, list[int]] = {}
        for request in decodes:
            k = min(self.num_tokens, room.get(request.request_id, 0), budget)
            if k <= 0 or not self.eligible(request):
                continue
            guess = self.proposer.propose(request, k)
            if guess:
                drafts[request.request_id] = guess
                budget -= len(guess)
        if not drafts:
            return drafts
        # Each draft is one more decode row. Its expected value is the chance it is accepted
        # (a^i for the i-th draft of a request with per-draft acceptance a), so the rows are
        # added best first, and the step keeps the prefix with the most expected tokens per
        # estimated second, if that beats plain decoding by min_gain and fits the slack.
        tokens = len(decodes)
        load = StepLoad.decodes(tokens, sum(r.num_computed_tokens + 1 for r in decodes))
        by_id = {r.request_id: r for r in decodes}
        candidates = []
        for rid, guess in drafts.items():
            a = self._acceptance.get(rid, PRIOR_ACCEPTANCE)
            candidates.extend((a ** i, rid, i) for i in range(1, len(guess) + 1))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        loads = [load]
        for _, rid, i in candidates:
            loads.append(loads[-1] + StepLoad.decodes(1, by_id[rid].num_computed_tokens + i + 1))
        seconds = self._price(loads)
        if seconds is None:
            return drafts  # nothing to price with: the batch-size rule alone decides
        best, best_rate = 0, self.min_gain * tokens / seconds[0]
        value = 0.0
        for taken, (v, _, _) in enumerate(candidates, 1):
            value += v
            if seconds[taken] > slack_s:
                break
            if (tokens + value) / seconds[taken] > best_rate:
                best, best_rate = taken, (tokens + value) / seconds[taken]
        if best == 0:
            self.stats.num_skipped_steps += 1
            return {}
        keep: dict[str, int] = {}
        for _, rid, i in candidates[:best]:  # a request's drafts enter in order: i is its count so far
            keep[rid] = max(keep.get(rid, 0), i)
        return {rid: drafts[rid][:n] for rid, n in keep.items()}

    def _price(self, loads: list[StepLoad]) -> Optional[list[float]]:
        """Seconds for each step load: all from the measured decode-row costs when they cover
        every row count, else all from the step estimator (one source, so they compare); None
        when neither can."""
        measured = [self.row_costs.estimate(load.num_tokens) for load in loads]
        if all(m is not None for m in measured):
            return measured  # type: ignore[return-value]
        if self.estimator is None:
            return None
        return [self.estimator.estimate(load) for load in loads]

    def observe_step(self, load: StepLoad, seconds: float) -> None:
        """A finished step's load and duration (pure-decode steps teach the row costs)."""
        self.row_costs.observe(load, seconds)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One verified step of a request: `accepted` of its `proposed` drafts were kept."""
        if proposed <= 0:
            return
        self.stats.num_draft_tokens += proposed
        self.stats.num_accepted_tokens += accepted
        # Drafts are checked in order until the first rejection: `accepted` successes in
        # `examined` Bernoulli trials is the per-draft rate's maximum-likelihood estimate.
        examined = accepted + (accepted < proposed)
        rate = accepted / examined
        old = self._acceptance.get(request_id, PRIOR_ACCEPTANCE)
        self._acceptance[request_id] = HISTORY_WEIGHT * old + (1 - HISTORY_WEIGHT) * rate

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
