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

Drafts only ever use the token budget left after decodes and prefills were planned, so
speculation never delays a prompt. Greedy requests without logprobs only: their verified
output is exactly what plain decoding gives (see engine/runner.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sloserve.sched.costs import StepCostEstimator, StepLoad
from sloserve.sched.drafts import DraftProposer
from sloserve.types import Request

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
        more decodes (the rule when no estimator prices steps); `min_gain`: the expected
        tokens-per-second ratio a step with drafts must reach over one without."""
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.estimator = estimator
        self.min_gain = min_gain
        self.stats = SpeculationStats()
        self._acceptance: dict[str, float] = {}

    @staticmethod
    def eligible(request: Request) -> bool:
        params = request.sampling_params
        return params.greedy and params.logprobs is None

    def expected_accepted(self, request_id: str, k: int) -> float:
        a = self._acceptance.get(request_id, PRIOR_ACCEPTANCE)
        return sum(a ** i for i in range(1, k + 1))

    def plan(self, decodes: list[Request], other: StepLoad, budget: int, slack_s: float,
             room: dict[str, int]) -> dict[str, list[int]]:
        """Drafts per request id for this step, or {} when they do not pay.

        `decodes`: the step's planned decodes; `other`: the load of the rest of the step (its
        prefill chunks); `budget`: tokens left in the step; `slack_s`: the tightest TBT slack
        among the decodes; `room[request_id]`: the most drafts that request may take."""
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
        if not drafts or self.estimator is None:
            return drafts
        plain = other + StepLoad.decodes(len(decodes), sum(r.num_computed_tokens + 1 for r in decodes))
        spec = other
        gain = 0.0
        for request in decodes:
            guess = drafts.get(request.request_id)
            if guess is None:
                spec = spec + StepLoad.decodes(1, request.num_computed_tokens + 1)
            else:  # one decode row becomes a (1 + k)-token chunk after the request's context
                spec = spec + StepLoad.verify(len(guess) + 1, request.num_computed_tokens)
                gain += self.expected_accepted(request.request_id, len(guess))
        plain_s = self.estimator.estimate(plain)
        spec_s = self.estimator.estimate(spec)
        tokens = len(decodes)
        if spec_s > slack_s or (tokens + gain) * plain_s < self.min_gain * tokens * spec_s:
            self.stats.num_skipped_steps += 1
            return {}
        return drafts

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
