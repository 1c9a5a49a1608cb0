"""Dynamic chunking: how many prefill tokens this step may carry.

A step's duration is the gap every running decode sees before its next token, so the
prefill tokens riding along should make the step just as long as the tightest decode can
afford: big chunks while decodes have slack (prefills finish sooner, TTFT drops), small
ones when a decode is about to miss its TBT target. A floor keeps prefills moving even when
decodes are already late, so waiting requests never starve.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

from sloserve.sched.costs import StepCostEstimator, StepLoad
from sloserve.sched.deadlines import next_deadline
from sloserve.core.types import Request


def tbt_slack(decodes: Iterable[Request], now: float) -> float:
    """Seconds until the earliest next-token deadline among the decodes (inf if none has one)."""
    return min((next_deadline(r) for r in decodes), default=math.inf) - now


def prefill_token_cap(decode_load: StepLoad, slack_s: float, estimator: Optional[StepCostEstimator],
                      max_tokens: int, min_tokens: int, start_hint: int = 0) -> int:
    """The most prefill tokens (between `min_tokens` and `max_tokens`) such that the step
    (the decodes of `decode_load` plus one chunk after `start_hint` cached tokens) is
    estimated to end within `slack_s`. Without an estimator or a finite slack: `max_tokens`.

    The estimate grows with the chunk, so a binary search over the chunk size finds it in
    log2(max_tokens) estimates.
    """
    min_tokens = max(0, min(min_tokens, max_tokens))
    if estimator is None or math.isinf(slack_s) or max_tokens <= min_tokens:
        return max_tokens

    def fits(n: int) -> bool:
        return estimator.estimate(decode_load + StepLoad.prefill(n, start_hint)) <= slack_s

    if fits(max_tokens):
        return max_tokens
    if not fits(min_tokens + 1):
        return min_tokens
    lo, hi = min_tokens + 1, max_tokens  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
